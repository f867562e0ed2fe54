"""Initial weights that depend on (seed, parameter name) alone, not on who builds them.

Every parameter is drawn from its own generator, seeded by a hash of the run's seed and the
parameter's unsplit name (`layers.{i}.{rest}`, so the layer index is part of it). A layer
therefore gets the same initial weights whether the unsplit model is built in one process,
or a stage holding it is materialized on any rank of any partition, in any order: nothing
is drawn from a shared stream whose position would depend on what was drawn before.

A tied copy (GPT-2's head, a tied Llama head) is initialised under its canonical name (the
embedding's), so both copies start equal wherever they live. Why one generator per
parameter rather than one per layer: a stage holding only the head must reproduce the
embedding's draw without replaying the embedding layer's other parameters (GPT-2's wpe).

Models built on torch's meta device hold shapes only; `init_parameters` allocates each
parameter on the target device as it initialises it (values are drawn on the CPU in fp32,
so they do not depend on the device or dtype either), keeping ties inside the module.
`materialize` does the same for a stage already split over tensor-parallel ranks and sharded by
FSDP2 on meta: it allocates only this rank's slices and shards, drawing one whole parameter at a
time and keeping its part (so no rank ever holds its whole stage, only its largest weight once).
A rule that can fill a block of a parameter (`BlockRule`: model.pretrained's files) is asked for just
the contiguous block a rank keeps where there is one (an expert-parallel rank's experts), so it reads
only those bytes; the seeded rule draws the whole parameter (its values are one stream).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from pipetrain.compat import to_empty


class Held(Protocol):
    """How this rank holds each parameter (parallel/split_weights.py: SplitWeights): its unsplit shape, and
    this rank's part of the unsplit value copied into the local tensor."""

    def full_shape(self, name: str, t: torch.Tensor) -> torch.Size: ...

    def keep_local(self, name: str, full: torch.Tensor, into: torch.Tensor) -> None: ...

    def block(self, name: str) -> Optional[tuple[int, int, int]]:
        """(dim, start, stop): the one contiguous block of the unsplit value this rank keeps (before its
        dp shard), or None: kept whole, or a split not worth reading apart."""
        ...

    def keep_shard(self, name: str, mine: torch.Tensor, into: torch.Tensor) -> None:
        """Like keep_local, with `mine` already this rank's `block`."""
        ...


class InitRule(Protocol):
    """What a model provides: fill `value` (fp32, CPU) with the initial value of the parameter
    named `name` in the unsplit model, drawing only from `generator`."""

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None: ...


@runtime_checkable
class BlockRule(InitRule, Protocol):
    """A rule that can also fill just `block` = (dim, start, stop) of the parameter of unsplit `shape`
    (`value` has the block's shape) without producing the rest: models/hf.py's PretrainedWeights."""

    def init_block(self, name: str, shape: torch.Size, block: tuple[int, int, int], value: torch.Tensor,
                   generator: torch.Generator) -> None: ...


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, unsplit parameter name), the same in every process."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()  # not hash(): salted per process
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)  # 63 bits


def embedding(num: int, dim: int) -> nn.Embedding:
    """An nn.Embedding that skips torch's default N(0, 1) draw: `init_parameters` draws every
    weight from (seed, name) afterwards anyway, and on the meta device (every rank builds its
    model there) that draw goes through torch._refs, which imports torch._dynamo: ~2.5 s of CPU
    in each process that builds a model, for nothing."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


@torch.no_grad()
def init_parameters(module: nn.Module, rule: InitRule, *, seed: int, device: Any = None,
                    canonical: Mapping[str, str] | None = None) -> None:
    """Give every parameter of `module` its initial value from (seed, canonical name).

    `canonical` maps a local name to the unsplit name it is a copy of (split.StageModule.tied);
    other names are their own. Parameters on the meta device are replaced by new ones on
    `device` (default cpu), one per original Parameter, so a tie inside `module` stays one
    Parameter; real parameters are overwritten in place (and moved to `device` if given).
    """
    canonical = canonical or {}
    done: dict[int, nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in done:
            key = canonical.get(name, name)
            value = torch.empty(p.shape, dtype=torch.float32, device="cpu")
            rule.init_parameter(key, value, param_generator(seed, key))
            if p.device.type == "meta" or (device is not None and torch.device(device) != p.device):
                target = device if device is not None else ("cpu" if p.device.type == "meta" else p.device)
                done[id(p)] = nn.Parameter(value.to(device=target, dtype=p.dtype), requires_grad=p.requires_grad)
            else:
                p.copy_(value)
                done[id(p)] = p
        if done[id(p)] is not p:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, done[id(p)])
    _no_meta_buffers(module)


def _no_meta_buffers(module: nn.Module) -> None:
    meta = [n for n, b in module.named_buffers() if b.device.type == "meta"]
    if meta:  # pipetrain's models derive constants in forward; a buffer would need its own rule
        raise RuntimeError(f"{type(module).__name__} keeps buffers {meta} that materializing cannot fill")


@torch.no_grad()
def materialize(module: nn.Module, rule: InitRule, held: Held, *, seed: int, device: Any,
                canonical: Mapping[str, str]) -> None:
    """Allocate a meta-device `module`'s parameters on `device` as this rank holds them (its tp
    slices, its FSDP2 shards: `held`) and fill each with its part of (seed, canonical name)'s value.
    One whole parameter is drawn at a time on the CPU, in fp32, as `init_parameters` draws it, so
    the values equal the unsplit model's bit for bit; a BlockRule fills only the block `held` keeps."""
    _no_meta_buffers(module)  # before to_empty, which would leave them uninitialized
    to_empty(module, device=device)  # the local shapes parallelizing left (a DTensor: its local shard)
    done: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in done:
            continue
        done.add(id(p))
        key = canonical.get(name, name)
        shape = held.full_shape(key, p)
        block = held.block(key) if isinstance(rule, BlockRule) else None
        if block is None:
            value = torch.empty(shape, dtype=torch.float32, device="cpu")
            rule.init_parameter(key, value, param_generator(seed, key))
            held.keep_local(key, value, p)
        else:
            dim, start, stop = block
            value = torch.empty((*shape[:dim], stop - start, *shape[dim + 1:]), dtype=torch.float32, device="cpu")
            rule.init_block(key, shape, block, value, param_generator(seed, key))
            held.keep_shard(key, value, p)
