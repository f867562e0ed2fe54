"""Tensor parallel inside a stage (Megatron-LM, Shoeybi et al. 2019; sequence parallel:
Korthikanti et al. 2022): the layers and collectives, on plain tensors.

Each tp rank holds a slice of every split weight as an ordinary Parameter under the unsplit
name (so the executor, split backward, FSDP2, tie sync and AdamW see plain local tensors):

  column-parallel  Linear(in, out): rows `index` of the weight (and bias); the input enters
                   through `copy_to_tp` (identity forward, all-reduce of the input gradient
                   backward), the output stays split on its last dimension.
  row-parallel     Linear(in, out): columns `index` of the weight, the bias whole; the partial
                   products are all-reduced forward (`reduce_from_tp`, identity backward), then
                   the bias is added once.
  vocab-parallel   Embedding rows [r V/tp, (r+1) V/tp): ids outside look up zeros, then the
                   partial embeddings are all-reduced.
  head             column-parallel on the vocabulary, its (B, T, V/tp) logits left split: the loss
                   is the vocab-parallel cross-entropy (loss_parallel.py), so no tp rank ever holds
                   the whole (B, T, V) logits (2.1 GB in fp32 per 4,096-token row at Llama 3's V).

Sequence parallel: between the tp regions activations are (B, T/tp, C) per tp rank. Column-
parallel inputs are all-gathered on the sequence (backward: reduce-scatter), row-parallel and
vocab-parallel outputs reduce-scattered (backward: all-gather), so norms and dropout run on a
1/tp slice of the tokens; the weights used there see only their tokens and their gradients are
summed over the tp group after the step (`TensorParallel.partial`).

Every collective runs on the tp group, in the same order on every tp rank (they run the same
schedule on the same shapes), so the backward's collectives match as the forward's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int  # this rank's tp index
    sequence_parallel: bool = False


def _all_reduce(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """A new tensor: the sum of `x` over the tp group (`x` itself untouched)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=g.group)
    return out


def _all_gather(x: torch.Tensor, dim: int, g: TPGroup) -> torch.Tensor:
    """Every tp rank's `x`, concatenated on `dim` in tp order: one all_gather_into_tensor into a
    (tp, *x.shape) buffer (the list API copies through per-rank buffers, then cat copies again)."""
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))  # concatenated on dim 0: gloo takes no stack
    dist.all_gather_into_tensor(out, x.contiguous(), group=g.group)
    return out.view(g.size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)  # a view for dim 0; one copy otherwise


def _reduce_scatter(x: torch.Tensor, dim: int, g: TPGroup) -> torch.Tensor:
    """This rank's chunk on `dim` of the sum of `x` over the tp group (`x` untouched): one
    reduce_scatter_tensor over the chunks stacked first (gloo has it too in torch >= 2.6)."""
    chunks = x.unflatten(dim, (g.size, x.shape[dim] // g.size)).movedim(dim, 0).contiguous()  # (tp, ..., n/tp, ...)
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_tensor(out, chunks.flatten(0, 1), group=g.group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):  # type: ignore[override]
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # a copy: autograd may hand this same gradient tensor to other nodes too (AddBackward
        # returns one tensor for both of its inputs), so reducing it in place could change theirs
        return _all_reduce(grad, ctx.g), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: the sum over the tp group, IN PLACE on `x` (callers pass the fresh output of the
    F.linear / embedding before it, which no autograd node saved: mark_dirty makes autograd check
    that, raising at backward rather than reading a changed saved tensor); backward identity."""

    @staticmethod
    def forward(ctx, x, g):  # type: ignore[override]
        if not x.is_contiguous():  # in-place collectives need dense memory
            return _all_reduce(x, g)
        dist.all_reduce(x, group=g.group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _Gather(torch.autograd.Function):
    """Forward all-gather on `dim`; backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, dim, g):  # type: ignore[override]
        ctx.dim, ctx.g = dim, g
        return _all_gather(x, dim, g)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.dim, ctx.g), None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward reduce-scatter on `dim`; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, g):  # type: ignore[override]
        ctx.dim, ctx.g = dim, g
        return _reduce_scatter(x, dim, g)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather(grad, ctx.dim, ctx.g), None, None


class _Split(torch.autograd.Function):
    """Forward: this rank's chunk of a replicated tensor on `dim`; backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, g):  # type: ignore[override]
        ctx.dim, ctx.g = dim, g
        return x.chunk(g.size, dim=dim)[g.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather(grad, ctx.dim, ctx.g), None, None


SEQ = 1  # (B, T, C): the sequence dimension sequence parallel splits


def enter_tp(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Into a column-parallel region: (B, T, C) replicated, or (B, T/tp, C) gathered under SP."""
    return _Gather.apply(x, SEQ, g) if g.sequence_parallel else _CopyToTP.apply(x, g)


def leave_tp(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """Out of a row-parallel region: partial sums all-reduced, or reduce-scattered on T under SP."""
    return _ReduceScatter.apply(x, SEQ, g) if g.sequence_parallel else _ReduceFromTP.apply(x, g)


def enter_region(module: nn.Module, g: TPGroup) -> None:
    """Bring `module`'s input into the tp region once, for all its column-parallel projections."""
    module.register_forward_pre_hook(lambda _m, args: (enter_tp(args[0], g), *args[1:]))


def split_sequence(x: torch.Tensor, g: TPGroup) -> torch.Tensor:
    """A replicated (B, T, C) -> this rank's (B, T/tp, C) (backward: all-gather)."""
    return _Split.apply(x, SEQ, g)


@dataclass(frozen=True)
class Split:
    """How one weight is split over the tp group: on dimension `dim` of unsplit length `size`,
    each of `blocks` equal consecutive blocks cut in tp equal parts (GPT-2's fused c_attn:
    blocks=3, so tp rank r holds q, k and v of the same heads). Any tp rank's indices are a
    function of these numbers alone: no rank ever needs another's index tensor."""

    dim: int
    size: int
    blocks: int = 1

    def index(self, tp: int, rank: int, *, device: Optional[torch.device] = None) -> torch.Tensor:
        """The unsplit indices along `dim` that tp rank `rank` of `tp` holds, on `device`."""
        block = self.size // self.blocks
        part = block // tp
        return torch.cat([torch.arange(b * block + rank * part, b * block + (rank + 1) * part, device=device)
                          for b in range(self.blocks)])

    def runs(self, tp: int, rank: int) -> list[tuple[int, int, int]]:
        """`index` as contiguous runs: (start in the slice, start in the unsplit tensor, length), one per block."""
        block = self.size // self.blocks
        part = block // tp
        return [(b * part, b * block + rank * part, part) for b in range(self.blocks)]


class ColumnParallelLinear(nn.Module):
    """Rows `split.index(tp, rank)` of the weight (and bias): blocks=3 for GPT-2's fused c_attn."""

    def __init__(self, linear: nn.Linear, g: TPGroup, *, blocks: int = 1, enter: bool = True) -> None:
        super().__init__()
        # enter=False: the caller already brought the input into the region (one collective
        # for Llama's q, k, v and for gate, up: `enter_region`)
        self.g, self.enter = g, enter
        self.split = Split(0, linear.out_features, blocks)
        index = self.split.index(g.size, g.rank, device=linear.weight.device)
        self.weight = nn.Parameter(linear.weight.detach()[index].clone())  # (out/tp, in)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[index].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter_tp(x, self.g) if self.enter else x, self.weight, self.bias)  # (B, T, out/tp)


class RowParallelLinear(nn.Module):
    """Columns `split.index(tp, rank)` of the weight; the bias whole (added once, after the sum)."""

    def __init__(self, linear: nn.Linear, g: TPGroup) -> None:
        super().__init__()
        self.g, self.split = g, Split(1, linear.in_features)
        index = self.split.index(g.size, g.rank, device=linear.weight.device)
        self.weight = nn.Parameter(linear.weight.detach()[:, index].clone())  # (out, in/tp)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.linear's output is fresh and saved by no autograd node: the all-reduce runs in place on it
        y = leave_tp(F.linear(x, self.weight), self.g)  # (B, T, out) summed over tp (SP: (B, T/tp, out))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [r V/tp, (r+1) V/tp) of the table; the output is whole (B, T, C) on every tp rank
    (under sequence parallel the embedding layer splits it after its own additions)."""

    def __init__(self, emb: nn.Embedding, g: TPGroup, weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.g = g
        rows = emb.num_embeddings // g.size
        self.start, self.rows = g.rank * rows, rows
        self.split = Split(0, rows * g.size)
        self.weight = weight if weight is not None else nn.Parameter(
            emb.weight.detach()[self.start: self.start + rows].clone())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        outside = (local < 0) | (local >= self.rows)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C), rows of other ranks wrong
        return _ReduceFromTP.apply(y.masked_fill(outside.unsqueeze(-1), 0.0), self.g)


def split_experts(experts: nn.Module, g: TPGroup) -> dict[str, Split]:
    """Expert tensor parallel (etp = tp): keep this rank's 1/tp of every expert's width, rows of the stacked
    w1, w3 (E, I, H) and columns of w2 (E, H, I), the dense MLP's column-then-row split (on meta: shapes
    only), and declare the region on the module (`tp_region`: its rows enter it, backward summed over tp;
    its partial outputs leave it summed). Returns the local names' splits."""
    width = experts.w1.shape[1]
    splits = {"w1": Split(1, width), "w3": Split(1, width), "w2": Split(2, width)}
    for name, split in splits.items():
        p = getattr(experts, name)
        mine = p.detach().index_select(split.dim, split.index(g.size, g.rank, device=p.device)).clone()
        setattr(experts, name, nn.Parameter(mine, requires_grad=p.requires_grad))
    experts.tp_region = (lambda x: _CopyToTP.apply(x, g), lambda y: _ReduceFromTP.apply(y, g))
    return splits


def split_tokens(moe: nn.Module, g: TPGroup) -> None:
    """Experts whole (etp = 1) with ep over the tp ranks, which hold the same tokens: declare on the MoE layer
    (`tp_tokens`) which of them this rank dispatches (rank, size), how its rows enter the region (backward:
    summed over tp, every rank's tokens' expert gradients) and how each rank's rows, put in place among zeros,
    become every token's (an all-reduce; backward: the same gradient, every rank computes the rest alike).
    Under sequence parallel each tp rank holds its own 1/tp of the positions and dispatches them all: declare
    (`tp_sequence`) how the balance loss sums its counts over the tp group instead."""
    if g.sequence_parallel:
        moe.tp_sequence = (lambda counts: _all_reduce(counts.detach(), g), g.size)
        return
    moe.tp_tokens = (g.rank, g.size, lambda x: _CopyToTP.apply(x, g), lambda y: _ReduceFromTP.apply(y, g))


def shard_layout(module: nn.Module) -> dict[str, Split]:
    """Local parameter name -> how it is split over the tp group, for a module after `parallelize`."""
    out: dict[str, Split] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, (ColumnParallelLinear, VocabParallelEmbedding)):
            out[f"{prefix}weight"] = sub.split
            if getattr(sub, "bias", None) is not None:
                out[f"{prefix}bias"] = sub.split
        elif isinstance(sub, RowParallelLinear):
            out[f"{prefix}weight"] = sub.split
    return out


def gather_full(local: torch.Tensor, split: Split, g: TPGroup) -> torch.Tensor:
    """Collective over the tp group: the unsplit tensor from every rank's slice (tests, tools; a
    checkpoint never gathers: parallel/split_weights.py). Only the slices cross the group; each
    rank's indices are computed here, on the data's device (NCCL takes no CPU tensors, and
    index_copy_ wants its index where its data is)."""
    parts = list(_all_gather(local.unsqueeze(0), 0, g))  # tp x local.shape
    shape = list(local.shape)
    shape[split.dim] = split.size
    full = local.new_empty(shape)
    for r, part in enumerate(parts):
        full.index_copy_(split.dim, split.index(g.size, r, device=full.device), part)
    return full


def replace(parent: nn.Module, path: str, new: nn.Module) -> None:
    owner, _, attr = path.rpartition(".")
    setattr(parent.get_submodule(owner) if owner else parent, attr, new)


def all_reduce_grads(params: Sequence[nn.Parameter], g: TPGroup) -> None:
    """Sum the gradients of weights each tp rank used on part of the work (one flat all-reduce)."""
    from pipetrain.runtime.sync import local_tensor

    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([t.reshape(-1) for t in grads])
    dist.all_reduce(flat, group=g.group)
    offset = 0
    for t in grads:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
