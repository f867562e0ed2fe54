"""The MoE layer as a decoder block's MLP: a tensor in, a tensor out, balancing kept on the side.

A pipeline stage passes one tensor between layers and starts its backward from that tensor (or
the loss on the last stage), so the auxiliary balance loss of a block cannot be added to the
model's loss. Megatron's MoEAuxLossAutoScaler does it in backward instead: the layer output is
returned through `AttachAuxLoss`, whose backward hands the output's gradient through unchanged
and gives the aux loss a gradient of the block's `aux_loss_scale`, as if `aux_loss_scale * aux_loss`
had been added to the objective. Every stage's routers get their balance gradient in their own
backward, with no executor change. The objective is the mean over the step's microbatches of
(cross-entropy + sum of the blocks' aux losses) when aux_loss_scale = 1 / pipeline.microbatches,
which the trainer sets on the blocks of its stages (`set_aux_loss_scale`); it is 1 until then. A
block's own attribute, not a process-wide one: two models in one process (a test's pipeline and its
one-process reference) keep their own.

For aux_free balancing each MoEBlock counts the assignments per expert of every forward of the
step in `tokens_per_expert`, once per token: a forward re-run by activation recompute (inside
the backward pass) does not count again, nor does evaluation (no grad). `update_expert_biases`
is the optimizer pre-step hook: it sums the counts over the data-parallel ranks and moves each
router's bias (moe_router.py).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.compat import in_backward, untraced
from pipetrain.config.moe import MoEConfig
from pipetrain.models.moe import MoE, Plan
from pipetrain.models.moe_router import updated_expert_bias

def set_aux_loss_scale(module: nn.Module, scale: float) -> int:
    """The gradient each aux loss of the MoE blocks under `module` (a stage, a model) gets: 1 /
    pipeline.microbatches makes the objective the microbatch mean of (loss + aux losses), as the executor
    averages the loss (runtime/executor.py). Returns how many blocks it set."""
    blocks = [b for _, b in moe_blocks(module)]
    for b in blocks:
        b.aux_loss_scale = float(scale)
    return len(blocks)


class AttachAuxLoss(torch.autograd.Function):
    """(out, aux_loss, scale) -> out; backward: out's gradient unchanged, the aux loss's = scale."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class MoEBlock(MoE):
    """The MLP of an MoE decoder block (models/llama.py DecoderLayer): parameters named as MoE's
    (`router.weight`, `router.expert_bias`, `experts.w1|w2|w3`, `shared_experts.*`).

    Kept per step, for the trainer and metrics: `tokens_per_expert` (E,) int64 summed over the
    step's forwards (None before the first), `aux_loss_sum` and `dropped_sum` (detached) with
    `forwards` counting them."""

    def __init__(self, config: MoEConfig, *, hidden: int, model_intermediate: int) -> None:
        super().__init__(config, hidden=hidden, intermediate=config.expert_width(model_intermediate),
                         shared_intermediate=config.shared_width(model_intermediate) or None)
        self.aux_loss_scale = 1.0  # d(objective) / d(this block's aux loss of one microbatch): set_aux_loss_scale
        self.reset_step_stats()

    def reset_step_stats(self) -> None:
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self.aux_loss_sum: Optional[torch.Tensor] = None
        self.dropped_sum: Optional[torch.Tensor] = None
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x).out  # route counted, gather attached the balance loss

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Plan]:
        """MoE.route's phase, counting the forward (whole-stage and node execution both run it)."""
        xs, gates, flat, aux, plan = super().route(h)
        self.count(plan.counts, aux, plan.dropped)
        return xs, gates, flat, aux, plan

    def gather(self, ys: torch.Tensor, gates: torch.Tensor, flat: torch.Tensor, aux: torch.Tensor,
               plan: Plan) -> torch.Tensor:
        """MoE.gather's phase with the balance loss's gradient attached to the output (AttachAuxLoss)."""
        return self.attach(super().gather(ys, gates, flat, aux, plan), aux)

    def count(self, counts: torch.Tensor, aux: torch.Tensor, dropped: torch.Tensor) -> None:
        """Add one forward's statistics."""
        # Training forwards only: not evaluation (no grad), nor a forward recompute re-runs in backward.
        # Outside a compiled graph (untraced): traced, the Python count (self.forwards) is a guard that failed
        # at every forward, recompiling the block until dynamo's limit (compiled moe-tiny 1F1B: 9x eager's step).
        if torch.is_grad_enabled() and not in_backward():
            untraced(self._add)(counts.detach(), aux.detach(), dropped.detach())

    def _add(self, counts: torch.Tensor, aux: torch.Tensor, dropped: torch.Tensor) -> None:
        with torch.no_grad():
            first = self.tokens_per_expert is None
            self.tokens_per_expert = counts.clone() if first else self.tokens_per_expert + counts
            self.aux_loss_sum = aux.clone() if first else self.aux_loss_sum + aux
            self.dropped_sum = dropped.clone() if first else self.dropped_sum + dropped
            self.forwards += 1

    def attach(self, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """The layer output with its balance loss's gradient attached (AttachAuxLoss) where it has one."""
        if self.config.balance in ("aux_loss", "seq_aux_loss") and torch.is_grad_enabled():
            # under sequence parallel the tp group sums the router's gradient (each rank's share of the
            # whole loss, as over cp where the gradients are averaged): 1/tp of each rank's
            tp = 1 if self.tp_sequence is None else self.tp_sequence[1]
            return AttachAuxLoss.apply(out, aux, self.aux_loss_scale / tp)
        return out


def moe_blocks(module: nn.Module) -> Iterator[tuple[str, MoEBlock]]:
    """Every MoE block under `module` (a stage, a model), with its name."""
    for name, m in module.named_modules():
        if isinstance(m, MoEBlock):
            yield name, m


@torch.no_grad()
def update_expert_biases(modules: list[nn.Module], group: Optional[dist.ProcessGroup] = None, *,
                         move: bool = True, sequence_group: Optional[dist.ProcessGroup] = None) -> int:
    """The optimizer pre-step hook of balance=aux_free: for every MoE block of `modules` (a rank's
    stages), sum the step's tokens per expert over `group` (the ranks holding the same blocks with
    other tokens: data and context parallel, whatever ranks the experts fold over; None: this
    process's counts alone; and first over `sequence_group`, the tp ranks under sequence parallel), move the
    router's bias by bias_update_rate x sign(mean - count)
    (moe_router.updated_expert_bias), then reset the step's statistics (only that with move=False).
    Every rank of `group` must call it with the same blocks in the same order (one all-reduce per
    block). Returns how many biases moved."""
    moved = 0
    for module in modules:
        for _, block in moe_blocks(module):
            c = block.config
            counts = block.tokens_per_expert
            if move and c.balance == "aux_free" and counts is not None:
                counts = counts.clone()
                for g in (sequence_group, group):
                    if g is not None and dist.get_world_size(g) > 1:
                        dist.all_reduce(counts, group=g)
                bias = block.router.expert_bias
                bias.copy_(updated_expert_bias(bias, counts, rate=c.bias_update_rate))
                moved += 1
            block.reset_step_stats()
    return moved


@torch.no_grad()
def moe_step_stats(modules: list[nn.Module]) -> dict[str, float]:
    """Metrics of the step so far, per MoE block of `modules` (this rank's stages), under the `moe/`
    namespace and the model's block names (`layers.{i}`, as layer_names): `imbalance` max / mean
    tokens per expert (1 = even), `aux_loss` and `dropped` (share of assignments over capacity) per
    forward, `bias_abs_max` the aux_free bias's largest magnitude. This rank's tokens only; read it
    before the optimizer pre-step hook resets the counts (update_expert_biases)."""
    out: dict[str, float] = {}
    for module in modules:
        for name, block in moe_blocks(module):
            counts = block.tokens_per_expert
            if counts is None or block.aux_loss_sum is None or block.dropped_sum is None:
                continue
            parts = name.split(".")  # [..., "layers", "<pipeline layer>", "mlp"]: block i is pipeline layer i + 1
            # an MTP depth's block (models/mtp.py): [..., "mtp", "<j>", "block", "mlp"] -> moe/mtp.<j>
            key = f"moe/mtp.{parts[-3]}" if parts[-4:-3] == ["mtp"] else f"moe/layers.{int(parts[-2]) - 1}"
            out[f"{key}/imbalance"] = float(counts.max()) / max(float(counts.double().mean()), 1e-12)
            out[f"{key}/aux_loss"] = float(block.aux_loss_sum) / block.forwards
            out[f"{key}/dropped"] = float(block.dropped_sum) / block.forwards
            out[f"{key}/bias_abs_max"] = float(block.router.expert_bias.abs().max())
    return out
