"""The typed records the trainer hands out: one `StepRecord` per step, one `RunSummary` per run.

The trainer produces them (train/trainer.py, with train/monitor.py for the measured part);
every logger, summary.json and the sweep table read only these, never the trainer's
internals. A record of a logged step on rank 0 carries the step's `StepMeasurement` (every
rank's timings and memory, measured against simulated); its numbers are reached through the
record's properties, and `row()` is the flat JSON object of metrics.jsonl (public names:
metrics/names.py).

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pipetrain.metrics import names
from pipetrain.metrics.measure import StepMeasurement


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as the trainer saw it."""

    step: int  # counted from 1
    loss: float  # mean over the step's microbatches (NaN on a rank without the last stage)
    lr: float
    grad_norm: float  # before clipping
    step_time_s: float
    tokens_per_s: float
    skipped: bool = False  # non-finite loss with trainer.on_nonfinite=skip: no optimizer step
    val_loss: Optional[float] = None  # at evaluation steps
    mfu: Optional[float] = None  # model FLOPs utilisation where a peak is known
    measurement: Optional[StepMeasurement] = None  # logged steps, rank 0: every rank's timings and memory
    data: dict[str, float] = field(default_factory=dict)  # the global batch's data/ metrics (names.data_metrics)
    losses: dict[str, float] = field(default_factory=dict)  # parts reported beside the loss (names.mtp_metrics)

    # ---- the measured part (None where the step was not measured) -------------------------
    @property
    def bubble_fraction_mean(self) -> Optional[float]:
        return self.measurement.bubble_mean if self.measurement else None

    @property
    def simulated_bubble_fraction(self) -> Optional[float]:
        return self.measurement.simulated.bubble_fraction_mean if self.measurement else None

    @property
    def peak_memory_bytes_per_rank(self) -> Optional[list[int]]:
        return [s.peak_memory_bytes for s in self.measurement.samples] if self.measurement else None

    @property
    def peak_activation_bytes_per_rank(self) -> Optional[list[int]]:
        return [s.peak_activation_bytes for s in self.measurement.samples] if self.measurement else None

    def rank_rows(self) -> list[dict[str, Any]]:
        """Per rank: bubble measured and simulated, memory split, ms per op and waiting ([] if unmeasured)."""
        return self.measurement.rank_rows() if self.measurement else []

    def row(self) -> dict[str, Any]:
        """The JSON object of metrics.jsonl, wandb and TensorBoard: `step`, then every metric
        under its public name (metrics/names.py); the measured ones on measured steps."""
        out: dict[str, Any] = {"step": self.step, names.LOSS: self.loss, **self.losses}
        if self.val_loss is not None:
            out[names.VAL_LOSS] = self.val_loss
        out.update({names.LR: self.lr, names.GRAD_NORM: self.grad_norm})
        if self.skipped:
            out[names.SKIPPED] = True
        out.update({names.TOKENS_PER_S: self.tokens_per_s, names.STEP_TIME: self.step_time_s})
        if self.mfu is not None:
            out[names.MFU] = self.mfu
        out.update(self.data)
        if self.measurement is not None:
            out.update(self.measurement.record())
        return out


@dataclass(frozen=True)
class RunSummary:
    """The run's outcome: what summary.json holds and the sweep table reads."""

    steps: int
    first_loss: Optional[float]
    final_loss: Optional[float]
    final_val_loss: Optional[float]
    skipped_steps: int
    tokens: int
    step_time_s: Optional[float]  # median over the steps after the first (which pays for warm-up)
    tokens_per_s: Optional[float]
    first_loss_step: int = 1  # the step first_loss is of: 1, or a resumed segment's first
    resumed_at: Optional[int] = None  # the step this run resumed at (a checkpoint), if it did
    # Over the measured steps (rank 0; `measured` is False when no step was measured)
    measured: bool = False
    ranks: list[int] = field(default_factory=list)  # the global rank of each per-rank entry ([]: 0, 1, ...)
    world_peak_memory_bytes: Optional[int] = None  # the most any rank of the world used (every replica)
    bubble_fraction_mean: Optional[float] = None  # median over the measured steps after the first
    simulated_bubble_fraction: Optional[float] = None
    bubble_fraction_per_rank: list[float] = field(default_factory=list)  # each rank's median, as the mean's
    simulated_bubble_fraction_per_rank: list[float] = field(default_factory=list)
    peak_memory_bytes_per_rank: list[int] = field(default_factory=list)  # the most any measured step used
    peak_activation_bytes_per_rank: list[int] = field(default_factory=list)
    peak_reserved_bytes_per_rank: list[int] = field(default_factory=list)  # GPU: the allocator's reserved peak
    mfu: Optional[float] = None
    # Data parallel: the most exposed reduce ms of any rank, median over the measured steps after the first
    reduce_exposed_ms: Optional[float] = None
    simulated_reduce_exposed_ms: Optional[float] = None

    def to_json(self) -> dict[str, Any]:
        """summary.json: `steps`, then the run's metrics under the names a step's have
        (metrics/names.py); the measured ones where a step was measured."""
        out: dict[str, Any] = {
            "steps": self.steps, names.FIRST_LOSS: self.first_loss, names.FIRST_LOSS_STEP: self.first_loss_step,
            names.RESUMED_AT: self.resumed_at, names.LOSS: self.final_loss,
            names.VAL_LOSS: self.final_val_loss, names.SKIPPED_STEPS: self.skipped_steps, names.TOKENS: self.tokens,
            names.STEP_TIME: self.step_time_s, names.TOKENS_PER_S: self.tokens_per_s,
        }
        if self.measured:
            peak, ranks = [names.gb(b) for b in self.peak_memory_bytes_per_rank], self.ranks or None
            out.update({
                names.BUBBLE: self.bubble_fraction_mean, names.BUBBLE_SIM: self.simulated_bubble_fraction,
                **names.per_rank(names.BUBBLE, self.bubble_fraction_per_rank, ranks),
                **names.per_rank(names.BUBBLE_SIM, self.simulated_bubble_fraction_per_rank, ranks),
                names.PEAK_GB: max([*peak, names.gb(self.world_peak_memory_bytes or 0)], default=None),
                **names.per_rank(names.PEAK_GB, peak, ranks),
                **names.per_rank(names.ACTIVATIONS_GB, [names.gb(b) for b in self.peak_activation_bytes_per_rank],
                                 ranks),
                names.MFU: self.mfu,
            })
            if self.peak_reserved_bytes_per_rank:  # on GPU
                reserved = [names.gb(b) for b in self.peak_reserved_bytes_per_rank]
                out.update({names.PEAK_RESERVED_GB: max(reserved),
                            **names.per_rank(names.PEAK_RESERVED_GB, reserved, ranks)})
            if self.reduce_exposed_ms is not None:
                out.update({names.REDUCE: self.reduce_exposed_ms, names.REDUCE_SIM: self.simulated_reduce_exposed_ms})
        return out
