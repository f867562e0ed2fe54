"""The trainer's side of metrics: measure a logged step on every rank, gather it to rank 0,
turn it into numbers there, and hand the typed records (metrics/step.py) to the loggers
`logger=[...]` names.

Only logged steps cost anything beyond the executor's own timestamps: one `gather_object`
of each rank's `RankSample` (timings, comm events, memory; a few kB), issued right after the
step's backward work and before the gradient-norm all-reduce, so the time rank 0 spends on
the measurement (the simulation with measured costs) is absorbed by that collective instead
of showing up as a late start, and so as bubble, in the next step.

Memory per rank is split into activations (the bytes autograd saved for the live
microbatches, counted by the executor's saved-tensor hooks) and the rest: on GPU the CUDA
allocator's peak minus the activations; on CPU the parameters, gradients and optimizer
state, counted from the tensors themselves. On GPU the allocator's reserved peak is reported
beside it (memory/peak_reserved_gb): what the process holds from the device, cached and
fragmented blocks included (still without the CUDA context and NCCL's own buffers).

The monitor gets what it reads (config, plan, device, run directory; at each logged step the
rank's parameters and optimizer), never the trainer: the trainer depends on it, not back.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.distributed as dist

from pipetrain.loggers.base import RunInfo
from pipetrain.loggers.factory import build_loggers
from pipetrain.metrics.measure import StepMeasurement, measure_step
from pipetrain.metrics.records import RankSample
from pipetrain.metrics.step import RunSummary, StepRecord
from pipetrain.runtime.step_result import StepResult
from pipetrain.runtime.sync import local_tensor
from pipetrain.schedules.export import rounded

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.plan import Plan

# Dense bf16 peak TFLOP/s of one device (vendor data sheets), the default MFU denominator.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def auto_peak_tflops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds (an FSDP2 shard: its local part)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, grad_bytes: int) -> int:
    """Bytes of the optimizer's state tensors. Before its first step AdamW holds none yet; it
    will hold exp_avg and exp_avg_sq per parameter (2 x the gradients), so that is reported."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return _nbytes(state) if state else 2 * grad_bytes


class Monitor:
    """Built on every rank; loggers exist on rank 0 only."""

    def __init__(self, config: Config, plan: Plan, *, device: torch.device, run_dir: Path) -> None:
        cfg = config
        self.config, self.plan, self.run_dir = config, plan, run_dir
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.chosen_step = cfg.logging.chosen_step(cfg.trainer.max_steps)
        # Training FLOPs per token: forward + B + W = 3 x forward (the cost model's split,
        # nanoGPT's 6N + 12LCT); MFU over every device. Under tensor parallel the plan's layer
        # costs are one tp rank's share (schedules/tp_cost.py): the model's FLOPs are tp times them.
        self.flops_per_token = 3.0 * sum(c.flops_per_token for c in plan.layer_costs) * cfg.parallel.tp
        self.peak_tflops = cfg.logging.peak_tflops or auto_peak_tflops(device)
        self.loggers = build_loggers(cfg.logger) if self.rank == 0 else []
        # rank 0: the last and the chosen measured step in full; of the others only what the
        # summary needs (a long run logs thousands of steps)
        self.last: Optional[StepRecord] = None
        self.chosen: Optional[StepRecord] = None
        # (step, measured, simulated) mean bubble, and the measured bubble of each rank
        self.bubbles: list[tuple[int, float, float, tuple[float, ...]]] = []
        self.reduces: list[tuple[int, float, float]] = []  # data parallel: (step, measured, simulated) most exposed
        self.peak_memory: list[int] = []  # per rank, the most over the measured steps
        self.world_peak = 0  # the most any rank of the world (every replica) used in a measured step
        self.peak_activations: list[int] = []
        self.peak_reserved: list[int] = []  # GPU: per rank, the most reserved over the measured steps

    # ---- every rank -----------------------------------------------------------------------
    def sample(self, result: StepResult, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               moe: Optional[dict[str, float]] = None, cp: Optional[dict[str, float]] = None) -> RankSample:
        grad_bytes = _nbytes(p for p in params if p.requires_grad)
        return RankSample(
            rank=self.rank, step_ms=result.step_ms, timings=result.timings, comm=result.comm,
            peak_activation_sets=result.peak_activation_sets, peak_activation_bytes=result.peak_activation_bytes,
            cuda_peak_bytes=result.peak_memory_bytes, cuda_reserved_bytes=result.peak_reserved_bytes,
            param_bytes=_nbytes(params), grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_state_bytes(optimizer, grad_bytes), reduce_exposed_ms=result.reduce_exposed_ms,
            reduce_issued_ms=result.reduce_issued_ms, reduce_done_ms=result.reduce_done_ms, sync_ms=result.sync_ms,
            moe=moe or {}, cp=cp or {},
        )

    def gather(self, step: int, result: StepResult, *, params: list[torch.nn.Parameter],
               optimizer: torch.optim.Optimizer, moe: Optional[dict[str, float]] = None,
               cp: Optional[dict[str, float]] = None) -> Optional[StepMeasurement]:
        """Collective (every rank, at logged steps only): rank 0 gets the step's measurement; `moe`
        and `cp` are this rank's MoE block and context-parallel counts of the step."""
        sample = self.sample(result, params, optimizer, moe, cp)
        samples: list[Any] = [sample]
        if self.world > 1:
            samples = [None] * self.world if self.rank == 0 else []
            dist.gather_object(sample, samples if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return None
        # Under data / tensor / context parallel every pipeline runs the same schedule: the timings are
        # pipeline 0's (rank 0's own), each named by its global rank; memory/peak_gb is every rank's.
        ranks = self.config.layout.pipelines()[0]
        first = [dataclasses.replace(samples[g], rank=p) for p, g in enumerate(ranks)]
        return measure_step(step, self.plan.schedule, first, comm_ms=self.config.sim.comm_ms,
                            reduce_ms=self.plan.reduce_ms, ranks=ranks,
                            world_peak_memory_bytes=max(s.peak_memory_bytes for s in samples))

    def mfu(self, tokens_per_s: float) -> Optional[float]:
        if not self.peak_tflops or not self.flops_per_token:
            return None
        return tokens_per_s * self.flops_per_token / (self.world * self.peak_tflops * 1e12)

    # ---- rank 0: the loggers --------------------------------------------------------------
    def start(self, start_step: int) -> None:
        """Collective: start the loggers; `start_step` is the optimizer steps already done."""
        cfg = self.config
        info = RunInfo(cfg, self.run_dir, cfg.trainer.max_steps, start_step, self.chosen_step)
        for lg in self.loggers:
            lg.start(info)
        if self.world > 1:
            # Rank 0's loggers may take a while to start (wandb: about a second); without this the
            # other ranks would begin step 1 early and its measured bubble would count the wait.
            dist.barrier()

    def progress(self, step: int) -> None:
        for lg in self.loggers:
            lg.progress(step)

    def log(self, record: StepRecord) -> None:
        """A logged step: rank 0 keeps what the summary needs of its measurement, then every
        logger gets the record."""
        if record.measurement is not None:
            self._keep(record)
        for lg in self.loggers:
            lg.log(record)

    def _keep(self, record: StepRecord) -> None:
        m = record.measurement
        assert m is not None
        self.last = record
        if record.step == self.chosen_step:
            self.chosen = record
        self.bubbles.append((record.step, m.bubble_mean, m.simulated.bubble_fraction_mean, tuple(m.bubble_per_rank)))
        if m.data_parallel:
            self.reduces.append((record.step, max(m.reduce_exposed_ms), max(m.simulated.reduce_exposed_ms)))
        mem = [s.peak_memory_bytes for s in m.samples]
        act = [s.peak_activation_bytes for s in m.samples]
        self.peak_memory = [max(a, b) for a, b in zip(self.peak_memory, mem)] if self.peak_memory else mem
        self.world_peak = max(self.world_peak, m.world_peak_memory_bytes or 0)
        self.peak_activations = ([max(a, b) for a, b in zip(self.peak_activations, act)]
                                 if self.peak_activations else act)
        reserved = [s.cuda_reserved_bytes for s in m.samples]
        if all(b is not None for b in reserved):
            self.peak_reserved = ([max(a, b) for a, b in zip(self.peak_reserved, reserved)]
                                  if self.peak_reserved else reserved)

    def note(self, text: str) -> None:
        for lg in self.loggers:
            lg.note(text)

    def event(self, kind: str, text: str, **fields: Any) -> None:
        """Something that happened to the run (a restart): every logger records it, the console shows `text`."""
        for lg in self.loggers:
            lg.event(kind, text, fields)

    def summarize(self, summary: RunSummary) -> RunSummary:
        """The run's summary with the measured results added (rank 0, where a step was measured):
        medians of the bubble over the measured steps, the mean's and each rank's (step 1 pays for
        warm-up: left out when there are others), peak memory as the most any step used."""
        if self.last is None or self.last.measurement is None:
            return summary
        steady = [b for b in self.bubbles if b[0] != 1] or self.bubbles
        reduces = [b for b in self.reduces if b[0] != 1] or self.reduces
        last = self.last.measurement
        return dataclasses.replace(
            summary, measured=True, ranks=list(last.global_ranks), world_peak_memory_bytes=self.world_peak or None,
            bubble_fraction_mean=statistics.median(b[1] for b in steady),
            simulated_bubble_fraction=statistics.median(b[2] for b in steady),
            bubble_fraction_per_rank=[rounded(statistics.median(b[3][r] for b in steady))
                                      for r in range(len(last.bubble_per_rank))],
            simulated_bubble_fraction_per_rank=[rounded(x) for x in last.simulated.bubble_fraction_per_rank],
            peak_memory_bytes_per_rank=self.peak_memory, peak_activation_bytes_per_rank=self.peak_activations,
            peak_reserved_bytes_per_rank=self.peak_reserved,
            mfu=self.mfu(summary.tokens_per_s) if summary.tokens_per_s else None,
            reduce_exposed_ms=statistics.median(b[1] for b in reduces) if reduces else None,
            simulated_reduce_exposed_ms=statistics.median(b[2] for b in reduces) if reduces else None,
        )

    def finish(self, summary: RunSummary) -> None:
        """Close every logger with the summary, the last measured step and the one chosen by
        logging.trace_step (a run resumed past it: the last)."""
        for lg in self.loggers:
            lg.finish(summary, self.last, self.chosen or self.last)
