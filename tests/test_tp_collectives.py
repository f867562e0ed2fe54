"""What crosses the tensor-parallel group, on 2 real gloo ranks (tp=2), seen by a dispatch mode
that records every c10d op as it runs (torch.utils._python_dispatch: the real collectives run,
nothing is replaced).

A checkpoint gathers nothing: each rank hands DCP its own parts of the split weights (#44).
F2 (review cuda-nccl-review.md): the tests' gather of the split weights sends only their
floating-point slices; every rank's indices are computed where they are used (NCCL takes no CPU
index tensors, and index_copy_ / index_select want the index on the data's device).
F13: the row-parallel all-reduce runs in place on F.linear's output (no clone in the forward),
the sequence-parallel collectives are all_gather_into_tensor / reduce_scatter_tensor, and the
results and gradients equal one process's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from _dist import spawn
from pipetrain.parallel.tp import (ColumnParallelLinear, RowParallelLinear, Split, TPGroup, VocabParallelEmbedding,
                                   enter_tp, gather_full, leave_tp, shard_layout)

C, V = 8, 12  # model width, vocabulary (both split in 2)


class Record(TorchDispatchMode):
    """The ops dispatched inside the `with`, with the tensors each c10d op took (run for real)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.sent: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        name = str(func)
        self.ops.append(name)
        if name.startswith("c10d."):
            for t in _tensors(args):
                self.sent.append((name, t.dtype))
        return func(*args, **(kwargs or {}))


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def unsplit() -> nn.ModuleDict:
    torch.manual_seed(0)  # the same whole layers on every rank
    return nn.ModuleDict({"qkv": nn.Linear(C, 3 * C), "proj": nn.Linear(C, C), "emb": nn.Embedding(V, C)})


def split(whole: nn.ModuleDict, g: TPGroup) -> nn.ModuleDict:
    return nn.ModuleDict({"qkv": ColumnParallelLinear(whole["qkv"], g, blocks=3),
                          "proj": RowParallelLinear(whole["proj"], g),
                          "emb": VocabParallelEmbedding(whole["emb"], g)})


def checkpoint_parts(rank: int, world: int, out: Path) -> None:
    """What a checkpoint hands DCP for every split weight (its parts of the unsplit tensor), and
    the gather the tests use, under the dispatch recorder."""
    from pipetrain.parallel.split_weights import SplitWeights

    g = TPGroup(None, world, rank)
    whole = unsplit()
    mods = split(whole, g)
    shards = SplitWeights(g, shard_layout(mods))
    parts, got, rec, parts_rec = {}, {}, Record(), Record()
    for name, p in mods.named_parameters():
        if name in shards.shards:
            with parts_rec:
                mine = shards.parts(name, p)
            parts[name] = {offsets: view.clone() for offsets, (_, view) in mine.boxes.items()}
            with rec:
                got[name] = gather_full(p.detach(), shards.shards[name], g)
    expect = dict(whole.named_parameters())
    torch.save({"sent": rec.sent, "parts_ops": parts_rec.ops, "parts": parts, "got": got,
                "expect": {k: v.detach() for k, v in expect.items()}}, out / f"gather{rank}.pt")


def collectives(rank: int, world: int, out: Path) -> None:
    """Row-parallel forward/backward and sequence-parallel enter/leave, vs one process's."""
    g = TPGroup(None, world, rank)
    whole = unsplit()
    mods = split(whole, g)
    torch.manual_seed(1)
    x = torch.randn(2, 4, C)  # (B, T, C), the same on every rank
    xr = x[..., rank * C // 2:(rank + 1) * C // 2].clone().requires_grad_()  # this rank's C/tp inputs
    rec = Record()
    with rec:
        y = mods["proj"](xr)  # (B, T, C) summed over tp
    y.square().sum().backward()
    xs = x[:, rank * 2:(rank + 1) * 2].clone().requires_grad_()  # SP: this rank's (B, T/tp, C)
    sp = TPGroup(None, world, rank, sequence_parallel=True)
    sp_rec = Record()
    with sp_rec:
        full = enter_tp(xs, sp)  # all-gather on T
        z = leave_tp(full * (rank + 1.0), sp)  # reduce-scatter on T
        z.sum().backward()  # backward: all-gather, then reduce-scatter
    torch.save({"fwd_ops": rec.ops, "sp_ops": sp_rec.ops, "y": y.detach(), "grad_w": mods["proj"].weight.grad,
                "grad_x": xr.grad, "full": full.detach(), "z": z.detach(), "grad_xs": xs.grad},
               out / f"coll{rank}.pt")


@pytest.mark.dist
def test_checkpoint_parts_tile_the_unsplit_weight_without_a_collective(tmp_path):
    """#44: a checkpoint hands DCP each rank's own parts of a split weight (no rank gathers
    another's); placed at their offsets, every rank's parts tile the unsplit tensor exactly.
    F2: the tests' gather sends only the floating-point slices (the int64 index of every slice
    was gathered too before, which NCCL refuses for CPU tensors)."""
    spawn(checkpoint_parts, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"gather{rank}.pt") for rank in range(2)]
    for res in ranks:
        assert not [op for op in res["parts_ops"] if op.startswith("c10d.")], res["parts_ops"]
        assert res["sent"] and {d for _, d in res["sent"]} == {torch.float32}, res["sent"]
        for name, t in res["got"].items():
            assert torch.equal(t, res["expect"][name]), name
    for name, expect in ranks[0]["expect"].items():
        if name not in ranks[0]["parts"]:
            continue
        tiled, count = torch.zeros_like(expect), torch.zeros_like(expect)
        for res in ranks:
            for offsets, view in res["parts"][name].items():
                box = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                tiled[box] += view
                count[box] += 1
        assert torch.equal(count, torch.ones_like(count)), name  # every element once
        assert torch.equal(tiled, expect), name
        assert len(ranks[0]["parts"][name]) == (3 if name.startswith("qkv.") else 1), name  # q, k, v of its heads


@pytest.mark.dist
def test_tp_collectives_in_place_and_tensor_apis(tmp_path):
    """F13: no clone in the row-parallel forward (the all-reduce runs in place on F.linear's
    output, autograd still right), sequence parallel through the tensor collectives; every
    number equal to one process's."""
    spawn(collectives, 2, tmp_path)
    whole = unsplit()
    torch.manual_seed(1)
    x = torch.randn(2, 4, C).requires_grad_()
    y = whole["proj"](x)
    y.square().sum().backward()
    ranks = [torch.load(tmp_path / f"coll{r}.pt") for r in range(2)]
    for r, res in enumerate(ranks):
        assert "aten.clone.default" not in res["fwd_ops"] and "c10d.allreduce_.default" in res["fwd_ops"]
        c10d = {op for op in res["sp_ops"] if op.startswith("c10d.")}
        assert c10d == {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"}, c10d
        torch.testing.assert_close(res["y"], y.detach(), rtol=1e-6, atol=1e-6)
        cols = slice(r * C // 2, (r + 1) * C // 2)
        torch.testing.assert_close(res["grad_w"], whole["proj"].weight.grad[:, cols], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["grad_x"], x.grad[..., cols], rtol=1e-5, atol=1e-5)
        # SP: enter gathers T (every rank the whole x); leave sums rank-scaled copies (1 + 2 = 3x)
        # and keeps this rank's T/tp; backward: 3 for every element of this rank's tokens
        torch.testing.assert_close(res["full"], x.detach(), rtol=0, atol=0)
        torch.testing.assert_close(res["z"], 3 * x.detach()[:, r * 2:(r + 1) * 2], rtol=0, atol=0)
        torch.testing.assert_close(res["grad_xs"], torch.full((2, 2, C), 3.0), rtol=0, atol=0)


@pytest.mark.pure
@pytest.mark.parametrize("size, blocks, tp", [(24, 3, 2), (12, 1, 4), (16, 2, 2), (8, 1, 1)])
def test_split_indices_cover_every_row_once_on_any_device(size, blocks, tp):
    """Every tp rank's indices from (size, blocks, tp, rank) alone: disjoint, together every row,
    each rank 1/tp of each block; made on the device asked for (meta here; cuda on GPUs)."""
    s = Split(0, size, blocks)
    parts = [s.index(tp, r) for r in range(tp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(size))
    block = size // blocks
    for r, idx in enumerate(parts):
        assert [int(i) // block for i in idx] == sorted([b for b in range(blocks)] * (block // tp))
        assert all((int(i) % block) // (block // tp) == r for i in idx)
    assert s.index(tp, 0, device=torch.device("meta")).device.type == "meta"


@pytest.mark.pure
def test_keep_local_indexes_on_the_data_device():
    """F2, load side: this rank's slice of an unsplit tensor, with the index made on that tensor's
    device (a meta tensor here stands for a CUDA one)."""
    from pipetrain.parallel.split_weights import SplitWeights

    g = TPGroup(None, 2, 1)
    shards = SplitWeights(g, {"w": Split(0, 24, 3)})
    full = torch.arange(24.0).unsqueeze(1)
    into = torch.empty(12, 1)
    shards.keep_local("w", full, into)
    assert into.squeeze(1).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    shards.keep_local("w", torch.empty(24, 1, device="meta"), torch.empty(12, 1, device="meta"))
