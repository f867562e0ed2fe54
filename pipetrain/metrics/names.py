"""The public names of every metric, in namespaces, the same in metrics.jsonl, summary.json,
wandb and TensorBoard.

  train/     loss, val_loss, lr, grad_norm, skipped; in summary.json also first_loss (of step
             first_loss_step: 1, unless resumed from a checkpoint older than first_loss), resumed_at
             (the step a resumed run started from, else null), skipped_steps, tokens
  perf/      tokens_per_s, step_time_s, mfu
  pipeline/  bubble_measured, bubble_simulated (mean over ranks; per rank under /rank<r>),
             makespan_ms, makespan_simulated_ms, per stage `pipeline/stage<s>/{f,b,w}_ms` (the
             measured median of one microbatch), under data parallel reduce_exposed_ms(_simulated)
             per rank and makespan_with_reduce_ms(_simulated)
  memory/    peak_gb (the most of any rank; per rank under /rank<r>), activations_gb, static_gb,
             activation_sets per rank; on GPU also peak_reserved_gb (the caching allocator's
             reserved peak: allocated + cached blocks, so fragmentation too; peak_gb is the
             allocated peak); GB = 10^9 bytes

  cp/        context parallel, per rank (`cp/<name>/rank<r>`) and the most of any rank: kv_bytes (K/V and
             their gradients that arrived from the cp group in the step), comm_ms (host ms blocked in
             the cp collectives: gloo's transfers, the ring's exposed waits; on GPU the launches only),
             gathered_kv_gb (allgather: the gathered K/V the step's forwards kept for backward, the part
             of memory/activations_gb that is not this rank's own), peak_kv_gb (the most K/V held at once
             inside one attention: own block + gathered whole, or own + in use + in flight)
  moe/       MoE models, per block `moe/layers.<i>/{imbalance,aux_loss,dropped,bias_abs_max}` (an MTP depth's
             block: `moe/mtp.<j>/...`)
             (imbalance: max / mean tokens per expert over the step, 1 = even; aux_loss and dropped
             per forward; the aux_free bias's largest magnitude) and their mean over blocks
             `moe/imbalance`; the measured pipeline's tokens (a block held twice, DualPipe's
             mirror: the mean of its copies); under expert parallel a2a_ms (the step's all-to-alls, the
             counts exchanges included, from issue to arrival), a2a_exposed_ms (of it, the time the rank
             sat blocked waiting: all of it when whole stages run, each all-to-all blocking), per rank under
             /rank<r> and their mean, and a2a_overlap = 1 - a2a_exposed_ms / a2a_ms (the share hidden under
             compute: 0 for whole stages, up to 1 with pipeline.fb_overlap's interleaved F&B pairs)
  mtp/       multi-token prediction (model.mtp.depth = D > 0, models/mtp.py): `mtp/loss_<k>` (k = 1..D), depth
             k's cross-entropy averaged over the microbatches as train/loss is (left out of train/loss and of
             mode=eval's loss, which are the main model's; reported beside them in metrics.jsonl and eval.json)
  data/      the global batch of the step: tokens (input positions holding a document's token, not
             padding), loss_tokens (targets trained on: != -1), padding (the share of input positions
             that are padding), per source `data/tokens/<name>` (data=datasets; data.sources' names)

A per-rank or per-stage value is its own scalar (`memory/peak_gb/rank0`), so every logger takes
the same flat {name: number} dict. `rank<r>` is the global rank: under data / tensor / context
parallel the measured pipeline's (pipeline 0: e.g. ranks 0 and 2 at pp=2 x tp=2), and peak_gb the
most of every rank of the world. Pure Python.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

LOSS, VAL_LOSS, LR, GRAD_NORM, SKIPPED = "train/loss", "train/val_loss", "train/lr", "train/grad_norm", "train/skipped"
FIRST_LOSS, SKIPPED_STEPS, TOKENS = "train/first_loss", "train/skipped_steps", "train/tokens"
FIRST_LOSS_STEP, RESUMED_AT = "train/first_loss_step", "train/resumed_at"
TOKENS_PER_S, STEP_TIME, MFU = "perf/tokens_per_s", "perf/step_time_s", "perf/mfu"
MOE_IMBALANCE = "moe/imbalance"
MOE_A2A_MS, MOE_A2A_EXPOSED_MS, MOE_A2A_OVERLAP = "moe/a2a_ms", "moe/a2a_exposed_ms", "moe/a2a_overlap"
BUBBLE, BUBBLE_SIM = "pipeline/bubble_measured", "pipeline/bubble_simulated"
MAKESPAN, MAKESPAN_SIM = "pipeline/makespan_ms", "pipeline/makespan_simulated_ms"
REDUCE, REDUCE_SIM = "pipeline/reduce_exposed_ms", "pipeline/reduce_exposed_simulated_ms"
MAKESPAN_REDUCE, MAKESPAN_REDUCE_SIM = "pipeline/makespan_with_reduce_ms", "pipeline/makespan_with_reduce_simulated_ms"
PEAK_GB, ACTIVATIONS_GB, STATIC_GB = "memory/peak_gb", "memory/activations_gb", "memory/static_gb"
PEAK_RESERVED_GB = "memory/peak_reserved_gb"
ACTIVATION_SETS = "memory/activation_sets"
DATA_TOKENS, DATA_LOSS_TOKENS, DATA_PADDING = "data/tokens", "data/loss_tokens", "data/padding"
CP_KV_BYTES, CP_COMM_MS = "cp/kv_bytes", "cp/comm_ms"
CP_GATHERED_GB, CP_PEAK_KV_GB = "cp/gathered_kv_gb", "cp/peak_kv_gb"


def mtp_loss(k: int) -> str:
    """The metric of MTP depth k (1..D)."""
    return f"mtp/loss_{k}"


def mtp_metrics(parts: Sequence[float]) -> dict[str, float]:
    """The `mtp/` metrics of a step's (or an evaluation's) per-depth losses, depth 1 first ({} without MTP)."""
    return {mtp_loss(k): v for k, v in enumerate(parts, start=1)}


def gb(n_bytes: int) -> float:
    return n_bytes / 1e9


def per_rank(name: str, values: Sequence[Any], ranks: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """`name/rank<r>` for each rank's value, r its global rank (`ranks`: those of the measured
    pipeline's ranks in pipeline order; None: 0, 1, ..., where the pipeline is every rank)."""
    return {f"{name}/rank{r}": v for r, v in zip(range(len(values)) if ranks is None else ranks, values)}


def per_stage(values: dict[str, Sequence[Any]]) -> dict[str, Any]:
    """{"f_ms": [stage 0, stage 1, ...]} -> `pipeline/stage<s>/f_ms`."""
    return {f"pipeline/stage{s}/{key}": v for key, vs in values.items() for s, v in enumerate(vs)}


def of_ranks(metrics: Mapping[str, Any], name: str) -> Optional[list[Any]]:
    """The per-rank values of `name` in a flat dict, in global rank order, which is pipeline order
    (pp is the layout's outermost dimension); None if it has none."""
    found = {int(k[len(name) + 5:]): v for k, v in metrics.items()
             if k.startswith(f"{name}/rank") and k[len(name) + 5:].isdigit()}
    return [found[r] for r in sorted(found)] or None


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a flat metrics dict (what wandb and TensorBoard plot): no step, no None."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}


def moe_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """The `moe/` metrics of one step from every measured rank's blocks: a block's value, or the mean
    of its copies where two ranks hold it; `moe/imbalance` the mean over blocks."""
    values: dict[str, list[float]] = {}
    for stats in per_rank:
        for key, v in stats.items():
            values.setdefault(key, []).append(v)
    out = {k: sum(v) / len(v) for k, v in sorted(values.items())}
    blocks = [v for k, v in out.items() if k.endswith("/imbalance")]
    if blocks:
        out[MOE_IMBALANCE] = sum(blocks) / len(blocks)
    return out


def a2a_metrics(per_rank_ms: Sequence[tuple[float, float]], ranks: Optional[Sequence[int]] = None) -> dict[str, float]:
    """The step's expert-parallel all-to-all time from each measured rank's (total ms, exposed ms): each
    per rank and their mean, and the share of the mean hidden under compute ({} without all-to-alls)."""
    if not any(total for total, _ in per_rank_ms):
        return {}
    total = sum(t for t, _ in per_rank_ms) / len(per_rank_ms)
    exposed = sum(e for _, e in per_rank_ms) / len(per_rank_ms)
    return {MOE_A2A_MS: round(total, 6), MOE_A2A_EXPOSED_MS: round(exposed, 6),
            MOE_A2A_OVERLAP: round(1.0 - exposed / total, 6),
            **per_rank(MOE_A2A_MS, [round(t, 6) for t, _ in per_rank_ms], ranks),
            **per_rank(MOE_A2A_EXPOSED_MS, [round(e, 6) for _, e in per_rank_ms], ranks)}


def cp_metrics(stats: Sequence[dict[str, float]], ranks: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The `cp/` metrics of one step from every measured rank's CPStats.take() ({} without context
    parallel): each per rank, and the most of any rank."""
    if not any(stats):
        return {}
    columns = ((CP_KV_BYTES, "kv_bytes", 1), (CP_COMM_MS, "comm_ms", 1),
               (CP_GATHERED_GB, "gathered_kv_bytes", 1e-9), (CP_PEAK_KV_GB, "peak_kv_bytes", 1e-9))
    out: dict[str, Any] = {}
    for name, key, unit in columns:
        values = [round(s.get(key, 0) * unit, 12) for s in stats]  # 12 places: a GB to the byte, without float noise
        out[name] = max(values)
        out.update(per_rank(name, values, ranks))
    return out


def data_metrics(*, tokens: int, loss_tokens: int, positions: int,
                 per_source: Optional[Mapping[str, int]] = None) -> dict[str, float]:
    """The `data/` metrics of one global batch: `positions` = batch_size x seq_len input positions, of
    which `tokens` hold a document's token; `per_source`: source name -> its tokens (its own key each)."""
    out: dict[str, float] = {DATA_TOKENS: tokens, DATA_LOSS_TOKENS: loss_tokens,
                             DATA_PADDING: round(1 - tokens / positions, 6) if positions else 0.0}
    out.update({f"{DATA_TOKENS}/{name}": n for name, n in (per_source or {}).items()})
    return out
