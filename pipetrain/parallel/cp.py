"""Context parallel: causal attention over a sequence split across the cp group (first piece of
issue #30: the attention and its sharding, before the layout, data and loss plumbing).

Load balance (torchtitan's head-tail, Megatron's 2cp chunks): the sequence is cut into 2 cp equal
chunks and cp rank r takes chunks r and 2cp-1-r, so every rank's queries see the same amount of
causal work. A rank's tokens are `positions(seq_len, cp, r)`, in that order; inputs, labels and
RoPE's positions are sharded alike, and attention masks by the true positions.

Two ways to reach the other ranks' keys and values (`parallel.cp_rotate`):

  allgather  gather K and V (only the KV heads under grouped-query attention) over the cp group,
             attend with a causal mask built from the positions; backward reduce-scatters dK, dV.
  ring       K, V blocks travel around the ring (each rank sends its block on while it attends to
             the one it holds), partial results merged with the online softmax (log-sum-exp), so
             a rank holds its own block (kept for backward), the one in use and the one in flight:
             at cp=2 1/cp of the sequence plus one block, at cp > 2 plus two; the backward sends
             dK, dV around with them and they arrive home summed (Liu et al. 2023, Ring Attention).

Both equal full-sequence attention at a rank's positions (tests/test_cp_attention.py).

Document masks (runtime/documents.py, issue #46): a row's documents come from the whole row (every rank
has the step's full microbatches) and are cut as its positions are (`ContextAttention.local_documents`);
RoPE reads each position's place in its document. Allgather masks this rank's queries against every
key (B, 1, T/cp, T); the ring restricts that mask to each arriving block, and a block none of whose keys
shares a document with an earlier-or-equal query of this rank is skipped, not masked: no scores, no
softmax, no gradient (CPStats.skipped_blocks). The block still travels on: the ring's order is fixed.
The ring reads the stage's (B, 1, T/cp, T) boolean mask (one byte per query-key pair, built once per
stage forward): at long sequences a per-block mask from the document indices would hold less.

What the cp traffic costs is counted per rank in a `CPStats` (ContextAttention.stats, read and reset
by `take()` at a logged step): K/V bytes that arrived from the group (gradients included), host ms
blocked in the cp collectives, gathered K/V the forwards keep for backward, and the most K/V bytes
(this rank's own block, blocks gathered or in the ring) held at once (tests/test_cp_memory.py).
In a measured step each collective also reaches the step's record, inside the action that ran it
(runtime/collectives.py: the Chrome trace's cp row), its exposed time the same wait comm_ms counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.parallel.layer_spec import ContextPlanned
from pipetrain.runtime import collectives
from pipetrain.runtime.documents import Documents

SEQ = 2  # (B, heads, T, head_dim): the sequence dimension attention's inputs carry


@dataclass(frozen=True)
class CPGroup:
    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    ranks: tuple[int, ...] = ()  # global ranks by cp index (the ring's neighbours); () : the default group's


@dataclass
class CPStats:
    """One rank's context-parallel traffic since the last `take()` (every field summed, the peak a max)."""

    kv_bytes: int = 0  # K/V and their gradients that arrived from the cp group, forward and backward
    comm_ms: float = 0.0  # host ms blocked in the cp collectives (gloo: the transfer; the ring: its exposed wait)
    gathered_kv_bytes: int = 0  # allgather: the gathered K/V tensors the forwards keep for backward
    peak_kv_bytes: int = 0  # the most K/V bytes held at once inside attention: own block + gathered / in the ring
    skipped_blocks: int = 0  # ring, document masks: K/V blocks whose attention was skipped (forwards and backwards)

    def held(self, *blocks: torch.Tensor) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, sum(b.nbytes for b in blocks))

    def take(self) -> dict[str, float]:
        """The counts as numbers, and a fresh start."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for f in fields(self):
            setattr(self, f.name, f.default)
        return out


class _Blocked:
    """`with _Blocked(stats, label, nbytes):` adds the host time inside to stats.comm_ms, and a measured
    step gets the collective (runtime/collectives.py) as issued at mark `started` (None: on entry,
    a blocking one) and waited for inside: its exposed time is what comm_ms counts."""

    def __init__(self, stats: CPStats, label: str, nbytes: int, started: Optional[int] = None) -> None:
        self.stats, self.label, self.nbytes, self.started = stats, label, nbytes, started

    def __enter__(self) -> None:
        self.tap = collectives.sink()
        self.waited = self.tap.mark() if self.tap is not None else 0
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.stats.comm_ms += (time.perf_counter() - self.t0) * 1e3
        if self.tap is not None:
            started = self.waited if self.started is None else self.started
            self.tap.collective("cp", self.label, self.nbytes, started, self.waited)


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The (seq_len / cp,) positions cp rank `rank` holds: chunks rank and 2cp-1-rank of 2cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"parallel.cp={cp} cuts data.seq_len={seq_len} into {2 * cp} equal chunks (load balance): "
                         f"set data.seq_len to a multiple of {2 * cp}")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


class _GatherSeq(torch.autograd.Function):
    """Forward: every cp rank's K or V, concatenated on the sequence in cp order; backward: the
    gradient's sum over the group, this rank's part (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, g, stats):  # type: ignore[override]
        ctx.g, ctx.stats = g, stats
        parts = x.new_empty((g.size, *x.shape))
        with _Blocked(stats, "cp:allgather", (g.size - 1) * x.nbytes):
            dist.all_gather_into_tensor(parts.view(g.size * x.shape[0], *x.shape[1:]), x.contiguous(), group=g.group)
        stats.kv_bytes += (g.size - 1) * x.nbytes
        out = torch.cat(list(parts), dim=SEQ)
        stats.gathered_kv_bytes += out.nbytes  # attention saves it for backward
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = ctx.g
        chunks = torch.stack(grad.chunk(g.size, dim=SEQ)).contiguous()  # (cp, B, KV, T/cp, hd)
        out = grad.new_empty(chunks.shape[1:])
        with _Blocked(ctx.stats, "cp:reduce_scatter", (g.size - 1) * out.nbytes):
            dist.reduce_scatter_tensor(out, chunks.view(-1, *chunks.shape[2:]), group=g.group)
        ctx.stats.kv_bytes += (g.size - 1) * out.nbytes
        return out, None, None


def causal_mask(seq_len: int, g: CPGroup, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(T/cp, T) additive mask over the gathered keys (in cp order): 0 where the key's true position
    is at most the query's, -inf elsewhere. Additive in the query's dtype because attention converts
    a boolean mask to that per call and saves the copy: one mask shared by every layer instead."""
    mine = positions(seq_len, g.size, g.rank).to(device)
    every = torch.cat([positions(seq_len, g.size, r) for r in range(g.size)]).to(device)
    mask = torch.zeros((len(mine), seq_len), device=device, dtype=dtype)
    return mask.masked_fill_(every[None, :] > mine[:, None], float("-inf"))


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, seq_len: int,
                        scale: Optional[float] = None, stats: Optional[CPStats] = None,
                        mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q (B, H, T/cp, hd), k, v (B, KV, T/cp, hd) at this rank's positions -> (B, H, T/cp, hd);
    `mask`: causal_mask's, where the caller keeps one; `stats`: where the traffic is counted."""
    stats = CPStats() if stats is None else stats
    mask = causal_mask(seq_len, g, q.device, q.dtype) if mask is None else mask
    k_all, v_all = _GatherSeq.apply(k, g, stats), _GatherSeq.apply(v, g, stats)
    stats.held(k, v, k_all, v_all)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, KV, T, hd) -> (B, H, T, hd): query head j reads KV head j // (H / KV)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def _fold(dx: torch.Tensor, kv: int) -> torch.Tensor:
    """The inverse of _expand for gradients: (B, H, T, hd) summed per KV head -> (B, KV, T, hd)."""
    b, h, t, d = dx.shape
    return dx.view(b, kv, h // kv, t, d).sum(2) if h != kv else dx


class _Ring:
    """One ring pass: this rank's tensors go to rank+1, rank-1's arrive (batched isend / irecv)."""

    def __init__(self, g: CPGroup, stats: CPStats, label: str) -> None:
        self.g, self.stats, self.label = g, stats, label
        self.started, self.nbytes = None, 0  # the pass in flight: its start mark (measured steps), bytes
        ranks = g.ranks or tuple(range(g.size))
        self.next, self.prev = ranks[(g.rank + 1) % g.size], ranks[(g.rank - 1) % g.size]

    def start(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        incoming = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # dense, as P2P needs
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, group=self.g.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, group=self.g.group) for t in incoming]
        self.nbytes = sum(t.nbytes for t in incoming)
        self.stats.kv_bytes += self.nbytes
        tap = collectives.sink()
        self.started = tap.mark() if tap is not None else None
        return incoming, dist.batch_isend_irecv(ops)

    def wait(self, works: list) -> None:
        with _Blocked(self.stats, self.label, self.nbytes, self.started):
            for w in works:
                w.wait()

    def held(self, own: tuple[torch.Tensor, ...], now: tuple[torch.Tensor, ...], coming: tuple[torch.Tensor, ...]
             ) -> None:
        """K/V alive at once: the own block (kept for backward), the one in use, the one arriving."""
        self.stats.held(*own, *(now if now[0] is not own[0] else ()), *coming)


def _block(q, k, v, qpos, kpos, scale, mask=None):
    """Scores of one K/V block: (B, H, Tq, Tk) with -inf where the key is later than the query, or with a
    document mask (B, 1, Tq, Tk) where the key is not an earlier-or-equal one of the query's document."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    return s.masked_fill(~(kpos[None, :] <= qpos[:, None]) if mask is None else ~mask, float("-inf"))


def _block_mask(mask: Optional[torch.Tensor], src: int, size: int) -> Optional[torch.Tensor]:
    """The document mask (B, 1, Tq, T) in gathered order restricted to cp rank src's keys: (B, 1, Tq, T/cp)."""
    return None if mask is None else mask[..., src * size:(src + 1) * size]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, seq_len, scale, stats, mask):  # type: ignore[override]
        heads, ring = q.shape[1], _Ring(g, stats, "cp:ring")
        qpos = positions(seq_len, g.size, g.rank).to(q.device)
        acc = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32)  # (B, H, Tq, d_v): MLA's d_v != d_qk
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, Tq)
        kb, vb = k, v
        for i in range(g.size):
            src = (g.rank - i) % g.size  # whose block this rank holds now
            works, coming = None, ()
            if i + 1 < g.size:
                (kn, vn), works = ring.start([kb, vb])  # the next block travels while this one is used
                coming = (kn, vn)
            ring.held((k, v), (kb, vb), coming)
            bmask = _block_mask(mask, src, k.shape[SEQ])
            if bmask is not None and not bool(bmask.any()):  # no query of this rank sees a key of the block
                stats.skipped_blocks += 1
            else:
                s = _block(q.float(), _expand(kb, heads).float(), None, qpos,
                           positions(seq_len, g.size, src).to(q.device), scale, bmask)
                block_lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq); -inf where no key is visible
                new = torch.logaddexp(lse, block_lse)
                p = torch.exp(s - new.unsqueeze(-1)).nan_to_num(0.0)
                acc = acc * torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1) + \
                    torch.matmul(p, _expand(vb, heads).float())
                lse = new
            if works is not None:
                ring.wait(works)
                kb, vb = kn, vn
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.g, ctx.seq_len, ctx.scale, ctx.stats = g, seq_len, scale, stats
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        g, seq_len, scale = ctx.g, ctx.seq_len, ctx.scale
        heads, kv, ring = q.shape[1], k.shape[1], _Ring(g, ctx.stats, "cp:ring B")
        qpos = positions(seq_len, g.size, g.rank).to(q.device)
        qf, dof = q.float(), dout.float()
        delta = (dof * out.float()).sum(-1, keepdim=True)  # (B, H, Tq, 1)
        dq = torch.zeros_like(qf)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for i in range(g.size):
            src = (g.rank - i) % g.size
            bmask = _block_mask(mask, src, k.shape[SEQ])
            if bmask is not None and not bool(bmask.any()):  # skipped in the forward: no gradient either
                ctx.stats.skipped_blocks += 1
            else:
                kf, vf = _expand(kb, heads).float(), _expand(vb, heads).float()
                s = _block(qf, kf, None, qpos, positions(seq_len, g.size, src).to(q.device), scale, bmask)
                p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # (B, H, Tq, Tk)
                dp = torch.matmul(dof, vf.transpose(-2, -1))
                ds = p * (dp - delta) * scale
                dq += torch.matmul(ds, kf)
                dkb = dkb + _fold(torch.matmul(ds.transpose(-2, -1), qf), kv)
                dvb = dvb + _fold(torch.matmul(p.transpose(-2, -1), dof), kv)
            if g.size == 1:
                continue
            # the block and its gradient so far move on together; the last move takes the gradients
            # home alone (the block itself is home already: it is k, v)
            if i + 1 < g.size:
                arrived, works = ring.start([kb, vb, dkb, dvb])
                ring.held((k, v), (kb, vb), tuple(arrived[:2]))
                ring.wait(works)
                kb, vb, dkb, dvb = arrived
            else:
                (dkb, dvb), works = ring.start([dkb, dvb])
                ring.wait(works)
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: CPGroup, seq_len: int,
                   scale: Optional[float] = None, stats: Optional[CPStats] = None,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As allgather_attention, with K/V blocks passed around the ring (no rank holds them all); `mask`
    (B, 1, T/cp, T) bool, keys in gathered order: a document mask (Documents.attention_mask), else causal."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, g, seq_len, scale, CPStats() if stats is None else stats, mask)


class ContextAttention:
    """What a declared attention module calls under context parallel: RoPE's tables at this rank's
    positions, and attention over the whole sequence's keys and values from the cp group."""

    def __init__(self, g: CPGroup, seq_len: int, rotate: str) -> None:
        self.g, self.seq_len = g, seq_len
        self.stats = CPStats()  # this rank's cp traffic, taken at logged steps
        self.rotate = rotate
        self.positions = positions(seq_len, g.size, g.rank)
        self.gathered = torch.cat([positions(seq_len, g.size, r) for r in range(g.size)])  # (T,) keys' positions
        self._masks: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # allgather: one per (device, dtype)

    def tables(self, rotary, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary.tables(self.seq_len, device, dtype)  # (T, hd) of the whole sequence, cached
        pos = self.positions.to(device)
        return cos[pos], sin[pos]

    def local_documents(self, docs: Documents) -> Documents:
        """A whole row's documents (B, T) cut to this rank's positions (the queries), with the document of
        every key in gathered order and which keys come at or before each query (runtime/documents.py)."""
        pos, every = self.positions, self.gathered
        return Documents(docs.index[:, pos], docs.positions[:, pos], keys=docs.index[:, every],
                         causal=every[None, :] <= pos[:, None])  # (T/cp, T)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Optional[Documents] = None,
               scale: Optional[float] = None) -> torch.Tensor:
        """`docs` (this rank's cut, `local_documents`): attention within each document, else causal; `scale`:
        the softmax's (None: head_dim^-1/2). v's head dim may differ from q's and k's (MLA: models/mla.py)."""
        if docs is not None and docs.keys is None:
            raise RuntimeError("context parallel attends within documents cut from whole rows "
                               "(Parallelize.local_documents): pass them to the step, not only the cut rows")
        mask = None if docs is None else docs.attention_mask()  # (B, 1, T/cp, T) bool
        if self.rotate == "ring":
            return ring_attention(q, k, v, self.g, self.seq_len, scale=scale, stats=self.stats, mask=mask)
        if mask is None:
            key = (str(q.device), q.dtype)
            if key not in self._masks:
                self._masks[key] = causal_mask(self.seq_len, self.g, q.device, q.dtype)
            mask = self._masks[key]
        return allgather_attention(q, k, v, self.g, self.seq_len, scale=scale, stats=self.stats, mask=mask)

    def sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-token counts of this rank's positions summed over the group (an MoE balance loss's), no grad."""
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.g.group)
        return counts

    def boundary_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A (B, T, C) tensor crossing between stages, as this cp rank holds it: (B, T/cp, C)."""
        b, t, *rest = shape
        return (b, t // self.g.size, *rest)


def parallelize_context(stage: torch.nn.Module, context: ContextAttention) -> torch.nn.Module:
    """Give every declared attention module of the stage the cp group's K/V, in place."""
    for layer in stage.layers.values():
        if isinstance(layer, ContextPlanned):
            for path in layer.cp_plan():
                layer.get_submodule(path).context = context
    return stage


def local_positions(rows: tuple[torch.Tensor, torch.Tensor], context: Optional[ContextAttention]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's (inputs, labels) (B, T) at this cp rank's positions (both alike: label i is the token
    after input i wherever position i goes); the batch itself without context parallel."""
    if context is None:
        return rows
    pos = context.positions
    return tuple(t[:, pos] for t in rows)  # type: ignore[return-value]


def context_parallel(groups, seq_len: int, rotate: str) -> Optional[ContextAttention]:
    """None without context parallel (parallel.cp = 1)."""
    if groups.layout.cp == 1:
        return None
    return ContextAttention(CPGroup(groups.cp_group, groups.layout.cp, groups.cp_index,
                                    tuple(groups.layout.cp_ranks(groups.rank))), seq_len, rotate)
