"""Vocab-parallel cross-entropy (Megatron-LM's `vocab_parallel_cross_entropy`, torchtitan's
`loss_parallel`): the loss of logits split on the vocabulary over the tp group, with no rank ever
holding a whole (N, V) row block.

Tp rank r holds the logits of vocabulary entries [r V/tp, (r+1) V/tp) for every token: the
column-parallel head's output, ungathered. Per token, over the whole vocabulary,

    loss = log(sum_v exp(z_v - m)) - (z_target - m),   m = max_v z_v

from three N-sized sums over the group: the row max (all-reduce MAX), then the sum of exp and
the target's logit (only the rank whose slice holds the target contributes it, the others 0),
both in one (2, N) all-reduce SUM. The mean is over the tokens whose target is not
`ignore_index`, as F.cross_entropy's. Backward: d loss / d z = (softmax - onehot) / n for the
counted tokens, all local: the rank's (N, V/tp) slice of the softmax is what the forward saves
(fp32, as torch's cross-entropy saves its fp32 log-softmax under bf16 autocast), and the
backward runs no collective.

Every collective runs on the tp group in the same order on every tp rank (the same shapes, the
same schedule). A one-rank group runs none: the function is then the plain cross-entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipetrain.parallel.tp import TPGroup


def _local_targets(target: torch.Tensor, g: TPGroup, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's slice, clamped to it; whether the slice holds the target) per token."""
    local = target - g.rank * vocab_local  # the slice starts at r V/tp (Split(0, V) of the head's rows)
    mine = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1), mine


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, g, ignore_index):  # type: ignore[override]
        # logits (N, V/tp) in the head's dtype; target (N,) int64 ids of the whole vocabulary
        z = logits.float()  # (N, V/tp) fp32: a new tensor under bf16, `logits` itself under fp32
        row_max = z.max(dim=-1).values  # (N,)
        if g.size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=g.group)
        exp = (z - row_max.unsqueeze(-1)).exp_()  # (N, V/tp): a new tensor (never `logits`), exp in place
        index, mine = _local_targets(target, g, z.size(-1))
        sums = torch.stack([exp.sum(dim=-1),  # (2, N): sum of exp; the target's shifted logit
                            (z.gather(-1, index.unsqueeze(-1)).squeeze(-1) - row_max) * mine])
        if g.size > 1:
            dist.all_reduce(sums, group=g.group)
        counted = target != ignore_index
        per_token = (sums[0].log() - sums[1]) * counted  # (N,)
        softmax = exp.div_(sums[0].unsqueeze(-1))  # in place: the exp is not needed again
        ctx.save_for_backward(softmax, target)
        ctx.g, ctx.ignore_index, ctx.dtype = g, ignore_index, logits.dtype
        return per_token.sum() / counted.sum()  # 0 / 0 = nan with every target ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, target = ctx.saved_tensors
        index, mine = _local_targets(target, ctx.g, softmax.size(-1))
        counted = target != ctx.ignore_index
        # a new tensor, not the saved softmax changed in place: a split backward (runtime/backward.py)
        # may run this node twice when it recomputes a weight group from the outputs
        d = softmax.scatter_add(-1, index.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))  # (N, V/tp)
        # clamp: a microbatch with no counted target (its seed is 0, runtime/step_loss.py) gets 0, not 0/0
        d.mul_((grad * counted / counted.sum().clamp(min=1)).unsqueeze(-1))
        return d.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, g: TPGroup, *,
                                 ignore_index: int = -1) -> torch.Tensor:
    """Mean cross-entropy of (..., V/tp) vocab-split logits against (...) whole-vocabulary targets,
    equal to F.cross_entropy of the gathered (..., V) logits; collective over the tp group."""
    v = logits.size(-1)
    return _VocabParallelCE.apply(logits.reshape(-1, v), target.reshape(-1), g, ignore_index)  # (B*T, V/tp), (B*T,)
