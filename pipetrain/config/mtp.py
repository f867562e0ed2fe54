"""model.mtp: multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2), and what a run must allow of it.

Depth D predicts D more tokens at each position, one depth after another (models/mtp.py): depth k reads
the previous depth's hidden states at positions 0..T-k-1 and the embeddings of the tokens k ahead, so a
row of T = data.seq_len tokens leaves T - k positions to depth k (0 = off). The objective is
L_main + (loss_weight / D) * sum_k L_k, each L_k a cross-entropy reported as `mtp/loss_k`.
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipetrain.config.data import DataConfig
    from pipetrain.config.parallel import ParallelConfig


@dataclass
class MTPConfig:
    """model.mtp.*: multi-token prediction (off at depth 0)."""

    depth: int = 0  # D: tokens predicted beyond the next one, one MTP module each (DeepSeek-V3: 1); 0 = off
    # lambda: the weight of the mean MTP loss in the objective (DeepSeek-V3: 0.3 for its first 10T tokens,
    # then 0.1; Megatron's mtp_loss_scaling_factor defaults to 0.1)
    loss_weight: float = 0.3

    def __post_init__(self) -> None:
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 0:
            raise ValueError(f"model.mtp.depth must be an integer >= 0 (got {self.depth!r}): 0 turns MTP off")
        if isinstance(self.loss_weight, bool) or not isinstance(self.loss_weight, (int, float)) \
                or not math.isfinite(self.loss_weight) or self.loss_weight < 0:
            raise ValueError(f"model.mtp.loss_weight must be a finite number >= 0 (got {self.loss_weight!r})")


def mtp_of(value: Any) -> MTPConfig:
    """model.mtp as given: a schema, a dict (a model built from its knobs), or None (off)."""
    if value is None:
        return MTPConfig()
    return MTPConfig(**value) if isinstance(value, dict) else value


def check_mtp(mtp: MTPConfig, *, model: str, data: DataConfig, parallel: ParallelConfig, compile: bool) -> None:
    """The run's refusals of an MTP model (depth > 0), each one line saying what to change."""
    if mtp.depth == 0:
        return
    d, seq_len, tp, cp = mtp.depth, data.seq_len, parallel.tp, parallel.cp
    if d >= seq_len:
        raise ValueError(f"model.mtp.depth={d} needs rows longer than {d} tokens (depth k predicts at the first "
                         f"T - k positions of a row), but data.seq_len={seq_len}: set model.mtp.depth < {seq_len}")
    for knob, degree in (("parallel.tp", tp), ("parallel.cp", cp)):
        if degree > 1:
            raise ValueError(f"model.mtp.depth={d} with {knob}={degree} is not supported yet (the MTP module runs "
                             f"whole, on whole rows): set {knob}=1 or model.mtp.depth=0 (model={model})")
    if compile:  # parallel/parallelize.py compiles each layer's forward; the depths run in the head's loss
        raise ValueError(f"model.mtp.depth={d} with trainer.compile=true is not supported yet (the MTP depths run "
                         f"in the head's loss, outside the compiled layers): set trainer.compile=false or "
                         f"model.mtp.depth=0")
    if data.masks_documents:
        raise ValueError(f"model.mtp.depth={d} with document masks is not supported yet (the MTP module attends "
                         f"causally over the whole row): set data.document_mask=false or model.mtp.depth=0")
