"""Assemble one rank's pipeline: its stage modules, P2P buffers, executor and grad sync.

Every rank is handed the same model, usually built on the meta device (shapes only), and
materializes the stages its placement gives it: each parameter initialised from (seed, its
name), so a layer's initial weights do not depend on the partition or the rank, and no rank
holds more than its own stages (models/init.py). A model built for real is copied instead.
Receive buffers get their shape and dtype from the model's boundary specs: an activation
entering stage s has the spec of its chunk's first layer boundary, the gradient sent back to
it the same. Under `precision="bf16"` a floating-point boundary crosses in bf16 (the executor
casts what it sends), so its buffers are bf16; integer boundaries (token ids) keep their dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models.base import COMPUTE_DTYPES, LayeredModel
from pipetrain.models.init import InitRule
from pipetrain.models.split import build_stage
from pipetrain.runtime.comm import P2P
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.step_result import StepResult
from pipetrain.parallel.dp import DataParallel
from pipetrain.parallel.pairs import build_pair_groups
from pipetrain.parallel.tp_plan import TensorParallel
from pipetrain.runtime.sync import GradSync
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.lower import split_on
from pipetrain.schedules.p2p import TRANSPORT_STREAMS, Kind, Message, exchange_pairs


def _pair_groups(schedule: Schedule, transport: str, group_ranks: Optional[list[int]],
                 pipelines: Optional[list[list[int]]], device: torch.device,
                 timeout_s: float) -> Optional[dict[int, dist.ProcessGroup]]:
    """pipeline.p2p_transport=pair_groups: this rank's pair groups by peer global rank (collective
    over the world); one_group: None (everything on the pipeline's group)."""
    if transport not in TRANSPORT_STREAMS:
        raise ValueError(f"pipeline.p2p_transport must be {' or '.join(TRANSPORT_STREAMS)} (got {transport!r})")
    if transport == "one_group" or not dist.is_initialized():
        return None
    if pipelines is None:  # one pipeline: the world, or the ranks of `group`
        pipelines = [group_ranks if group_ranks is not None else list(range(schedule.num_ranks))]
    # On NCCL the watchdog ends a hung P2P after the group's timeout (the host does not time its
    # waits there); gloo's waits are timed by the transport, so its groups keep the default.
    nccl = dist.get_backend() == "nccl"
    return build_pair_groups(exchange_pairs(schedule), pipelines, rank=dist.get_rank(), device=device,
                             timeout_s=timeout_s if nccl else None)


@dataclass
class RankPipeline:
    rank: int
    schedule: Schedule
    stages: dict[int, nn.Module]
    executor: Executor
    sync: GradSync
    tp: Optional[TensorParallel] = None

    def parameters(self) -> list[nn.Parameter]:
        """This rank's distinct parameters (a Parameter shared inside a stage appears once)."""
        seen: dict[int, nn.Parameter] = {}
        for s in sorted(self.stages):
            for p in self.stages[s].parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[int, str, nn.Parameter]]:
        """(stage, unsplit name, parameter) for every parameter of every local stage."""
        return [(s, n, p) for s in sorted(self.stages) for n, p in self.stages[s].named_parameters()]

    def train_step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """Forward and backward of all microbatches, then gradients summed over copies."""
        result = self.executor.step(microbatches)
        if self.tp is not None:  # whole weights each tp rank used on part of the tokens / heads
            self.tp.reduce_partial(self.stages)
        self.sync.sync()
        return result

    def close(self) -> None:
        self.executor.close()

    def norm_parameters(self) -> list[nn.Parameter]:
        """What this rank adds to the global gradient norm: the weights it owns in its pipeline
        (GradSync.owned), and under tensor parallel only its slices of split weights unless it
        is tp index 0 (whole weights are equal on every tp rank: counted once)."""
        if self.tp is None or self.tp.g.rank == 0:
            return self.sync.owned()
        return self.sync.owned(only=self.tp.sharded_names(self.stages))


def build_rank_pipeline(
    model: LayeredModel,
    bounds: Sequence[range],
    schedule: Schedule,
    rank: int,
    *,
    microbatch_size: int,
    seq_len: int = 1,
    timeout_s: float = 300.0,
    device: torch.device | str = "cpu",
    group: Optional[dist.ProcessGroup] = None,
    activation_checkpointing: bool | Collection[int] = False,
    p2p_lookahead: int = 1,
    p2p_in_order: bool = False,
    p2p_transport: str = "pair_groups",
    group_ranks: Optional[list[int]] = None,
    pipelines: Optional[list[list[int]]] = None,
    dp: Optional[DataParallel] = None,
    tp: Optional[TensorParallel] = None,
    compile_layers: bool | Collection[int] = False,
    precision: str = "fp32",
    seed: Optional[int] = None,
    init_rule: Optional[InitRule] = None,
) -> RankPipeline:
    """Collective when the schedule has several ranks: every rank must call it.

    `rank` is the pipeline rank; under data parallel `group` is this pipeline's process group,
    `group_ranks` its global ranks, `pipelines` every pipeline's global ranks, and `dp` wraps
    the stages (FSDP2 under dp_shard) and builds their gradient reducer (the schedule then
    carries REDUCE_GRAD marks); `p2p_transport` (pipeline.p2p_transport): "pair_groups" gives
    every pair of pipeline ranks that exchange tensors its own process group (every rank of the
    world creates every pipeline's: parallel/pairs.py), "one_group" posts all P2P on `group`;
    `tp` splits every stage's layers over its tensor-parallel group first (parallel/tp_plan.py);
    `compile_layers` (trainer.compile; a collection: those stage ids, plan.compiled_stages) compiles each
    layer of the stages after tensor parallel and before data parallel (torchtitan's order); the schedule
    must run their backward as BW (schedules/lower.py: fuse_backward, which plan.build_schedule applies);
    `activation_checkpointing`: True recomputes every stage's layers in its backward, a collection
    of stage ids those stages' (trainer.recompute_stages). `precision` is trainer.precision (fp32 | bf16); `seed`
    initialises the stages of a model built on meta, or `init_rule` gives their values
    (model.pretrained: models/hf.PretrainedWeights reads them from the folder's files)."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be {' or '.join(COMPUTE_DTYPES)} (got {precision!r})")
    compute_dtype = COMPUTE_DTYPES[precision]
    pl = schedule.placement
    if len(bounds) != pl.num_chunks:
        raise ValueError(f"the partition has {len(bounds)} chunks but the placement needs {pl.num_chunks}")
    compiled = frozenset(pl.stages_of(rank) if compile_layers is True else compile_layers or ())
    split = split_on(schedule, compiled.intersection(pl.stages_of(rank)))
    if split:
        raise ValueError(f"compiled stages cannot run B and W apart, but the schedule has {split[0]}: lower it "
                         f"with schedules/lower.py fuse_backward (plan.build_schedule does)")
    device = torch.device(device)
    stages = {s: build_stage(model, bounds[pl.chunk_of(s)], stage_id=s, seed=seed, device=device, rule=init_rule)
              for s in pl.stages_of(rank)}
    if tp is not None:  # torchtitan's order: cut, tensor parallel, (compile,) data parallel
        stages = {s: tp.wrap(mod) for s, mod in stages.items()}
    for mod in stages.values():
        mod.checkpoint_layers = activation_checkpointing if isinstance(activation_checkpointing, bool) else \
            mod.stage_id in activation_checkpointing
        if mod.stage_id in compiled:  # in place (nn.Module.compile): parameter names stay the unsplit ones
            for layer in mod.layers.values():
                layer.compile()
    if dp is not None:
        stages = {s: dp.wrap(mod) for s, mod in stages.items()}
    specs = model.boundary_specs(microbatch=microbatch_size, seq=seq_len)
    if tp is not None:  # sequence parallel: each tp rank sends and receives its (B, T/tp, C) part
        specs = [specs[0], *(dataclasses.replace(t, shape=tp.boundary_shape(t.shape)) for t in specs[1:-1]),
                 specs[-1]]
    if compute_dtype is not None:
        specs = [dataclasses.replace(t, dtype=compute_dtype) if t.dtype.is_floating_point else t for t in specs]

    def recv_buffer(msg: Message) -> torch.Tensor:
        rng = bounds[pl.chunk_of(msg.stage)]
        return specs[rng.stop if msg.kind is Kind.ACT else rng.start].empty(device)

    def consumer_stage(msg: Message) -> int:
        other = pl.next_stage(msg.stage) if msg.kind is Kind.ACT else pl.prev_stage(msg.stage)
        assert other is not None
        return other

    comm = None
    if schedule.num_ranks > 1:
        comm = P2P(rank, num_microbatches=schedule.num_microbatches, timeout_s=timeout_s, group=group,
                   group_ranks=group_ranks, in_order=p2p_in_order, consumer_stage=consumer_stage,
                   pair_groups=_pair_groups(schedule, p2p_transport, group_ranks, pipelines, device, timeout_s))
    # The loss is averaged over every rank's microbatches: the whole world (every pipeline).
    executor = Executor(schedule, rank, stages, comm=comm, recv_buffer=recv_buffer, device=device,
                        loss_group=group if pipelines is None else None, lookahead=p2p_lookahead,
                        reducer=dp.reducer(stages) if dp is not None else None, compute_dtype=compute_dtype)
    sync = GradSync(stages, group=group, pipelines=pipelines)
    return RankPipeline(rank, schedule, stages, executor, sync, tp)
