"""What one stage's data-parallel gradient reduction costs: bytes on the wire over bandwidth.

The bandwidth-optimal ring collectives (Patarasuk & Yuan 2009; NCCL's and gloo's ring
algorithms) move, per rank, for a buffer of S bytes over n ranks:

  all-reduce       2(n-1)/n x S    (reduce-scatter, then all-gather)   dp_replicate
  reduce-scatter     (n-1)/n x S                                        dp_shard (FSDP2)
  HSDP             (n_s-1)/n_s x S over dp_shard, then 2(n_r-1)/n_r x S/n_s over dp_replicate
                   (FSDP2 all-reduces the reduce-scattered shard across replicas)

S is the stage's parameter count x the bytes of `parallel.reduce_dtype` (4 for float32, 2 for
bfloat16). Latency terms are left out: a stage's gradients are tens of MB, where the ring's
bandwidth term dominates. One rank's bytes divided by `cluster.dp_bandwidth_gbs` (GB/s, 1e9
bytes) give the ms the simulator's communication lane is busy (schedules/simulate.py).

Pure Python, no torch.
"""

from __future__ import annotations

from typing import Sequence

from pipetrain.schedules.ir import Schedule

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def ring_factor(n: int, *, all_reduce: bool) -> float:
    """Bytes one rank sends per byte of buffer in a ring all-reduce (2(n-1)/n) or reduce-scatter ((n-1)/n)."""
    if n < 1:
        raise ValueError(f"a collective needs >= 1 rank (got {n})")
    return (2.0 if all_reduce else 1.0) * (n - 1) / n


def wire_bytes(nbytes: float, *, dp_replicate: int, dp_shard: int) -> float:
    """Bytes one rank moves to reduce a stage's `nbytes` of gradients over its data-parallel group."""
    shard = ring_factor(dp_shard, all_reduce=False) * nbytes  # reduce-scatter over dp_shard (0 when 1)
    return shard + ring_factor(dp_replicate, all_reduce=True) * nbytes / dp_shard  # then the shard over replicas


def stage_params(schedule: Schedule, chunk_params: Sequence[float]) -> tuple[float, ...]:
    """Parameters per stage id from parameters per model chunk, via the placement: DualPipe's
    mirrored stages each hold (and reduce) a copy of their chunk."""
    pl = schedule.placement
    if len(chunk_params) != pl.num_chunks:
        raise ValueError(f"expected parameters for {pl.num_chunks} model chunks, got {len(chunk_params)}")
    return tuple(float(chunk_params[pl.chunk_of(s)]) for s in range(pl.num_stages))


def reduce_ms(params: Sequence[float], *, dp_replicate: int, dp_shard: int, bandwidth_gbs: float,
              reduce_dtype: str = "float32") -> tuple[float, ...]:
    """Per stage, the ms its reduction keeps a rank's communication lane busy."""
    if not bandwidth_gbs > 0:
        raise ValueError(f"cluster.dp_bandwidth_gbs must be > 0 GB/s (got {bandwidth_gbs})")
    if reduce_dtype not in DTYPE_BYTES:
        raise ValueError(f"parallel.reduce_dtype={reduce_dtype!r} is unknown: choose one of {', '.join(DTYPE_BYTES)}")
    width = DTYPE_BYTES[reduce_dtype]
    return tuple(wire_bytes(p * width, dp_replicate=dp_replicate, dp_shard=dp_shard) / (bandwidth_gbs * 1e9) * 1e3
                 for p in params)
