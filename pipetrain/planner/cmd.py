"""`mode=plan`: rank every layout / schedule / microbatching in the `plan` group's space by
simulation; print the ranked table and write plan.json and plan.csv to the run directory.

Real models are costed on torch's meta device (no parameter memory), as mode=simulate does;
model=sleep stays pure Python.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.table import Table

from pipetrain.config import AUTO, Config, Mode, SleepModelConfig
from pipetrain.models.costs import autocast_copy_bytes, loss_bytes_per_token, tied_layers
from pipetrain.plan import costing_model, measured_layer_costs, model_layer_costs, seq_len
from pipetrain.planner import cluster
from pipetrain.planner.memory import StateBytes
from pipetrain.planner.search import Row, search
from pipetrain.planner.workload import Device, Workload
from pipetrain.planner.degrees import check_tp, cp_degrees, ep_degrees, tp_degrees, world_size
from pipetrain.planner.space import Candidate, candidates, why_empty
from pipetrain.schedules import registry

PLAN_FILE, PLAN_CSV = "plan.json", "plan.csv"
CSV_COLUMNS = ("rank", "layout", "schedule", "pp", "dp", "tp", "ep", "etp", "cp", "v", "microbatches",
               "microbatch_size", "recompute", "recompute_ranks", "partition", "feasible", "pred_step_ms",
               "tokens_per_s", "bubble", "pred_peak_gb", "peak_rank", "exposed_comm_ms", "memory_budget",
               "tflops_per_device", "hw_tflops_per_device", "mfu", "reason")
# activation values per token and unit of width a block keeps whole under tp without sequence parallel:
# the norms' inputs and outputs, the column-parallel layers' (replicated) inputs (models/gpt2.py: ln_1, c_attn,
# ln_2, c_fc inputs of its 17 C; models/llama.py: the two RMSNorms' 3 C each; DeepSeek's MLA the same, its whole
# latents left out: 3 q_lora_rank + 3 kv_lora_rank + d_r, 0.9 C at DeepSeek-V3); other models: all of it
TP_REPLICATED = {"gpt2": 4, "llama": 6, "deepseek": 6}
# what the planner cuts by; partition=profile cuts by measured time ("time") and calibrates the costs
PARTITIONS = {"uniform": "uniform", "params": "params", "flops": "flops", "balanced": "balanced", "profile": "time"}


def workload(config: Config) -> Workload:
    """The model's work as the planner reads it: its layers' costs per microbatch size (plan.py's
    model_layer_costs or measured_layer_costs, as a run costs them) and what crosses and stays."""
    m, p = config.model, config.plan
    seq = seq_len(config)
    first_stage: Optional[Callable[[int], list[float]]] = None
    sharded = None  # plan.device: layers timed at each tp x cp rank's shapes
    sleep = isinstance(m, SleepModelConfig)
    if not sleep and measuring(config):  # F, B, W and saved bytes measured here, one layer at a time (on meta)
        model = costing_model(m)
        from pipetrain.models.profile import saved_bytes_per_token
        from pipetrain.execution import profile_device

        dev = profile_device(config)
        precision = config.trainer.precision  # bf16: saved bytes under the stages' autocast

        @functools.lru_cache(maxsize=None)  # each view once per microbatch size (layers and the ratio read it)
        def activations(mbs: int, boundary_inputs: bool) -> tuple[float, ...]:  # without the weight copies
            saved = saved_bytes_per_token(model, batch=mbs, seq=seq, device=dev, precision=precision,
                                          boundary_inputs=boundary_inputs)
            return tuple(max(a - c / (mbs * seq), 0.0) for a, c in zip(saved, copies))

        def layers(mbs: int):  # saved bytes as a later stage keeps them (its residual stream in bf16)
            return [dataclasses.replace(c, activation_bytes_per_token=a)
                    for c, a in zip(measured_layer_costs(config, model, microbatch=mbs), activations(mbs, True))]

        def first_stage_ratio(mbs: int) -> list[float]:  # the first stage's residual stream stays fp32
            later, first = activations(mbs, True), activations(mbs, False)
            return [a / b if b else 1.0 for a, b in zip(first, later)]

        if precision != "fp32":
            first_stage = first_stage_ratio
    else:
        tflops, timed = p.tflops or config.sim.tflops, cluster.timing(config)

        def layers(mbs: int, tp: int = 1, cp: int = 1, sp: bool = False):  # the loss's bytes held apart (`in_head`)
            costs = model_layer_costs(m, microbatch=mbs, seq=seq, tflops=tflops, timing=timed, tp=tp, cp=cp,
                                      sequence_parallel=sp)
            if not in_head:
                return costs
            head = costs[-1]
            return [*costs[:-1], dataclasses.replace(
                head, activation_bytes_per_token=max(head.activation_bytes_per_token - in_head, 0.0))]
        if timed is not None:
            sharded = functools.lru_cache(maxsize=None)(layers)
    # what the loss keeps and autocast's weight copies, both held apart from the layers' per-token bytes (from
    # the config: models/costs.py, equal to what models/profile.py measures on the model built on meta)
    loss_bytes, copies = 0.0, []
    if not sleep:
        loss_bytes = loss_bytes_per_token(m, seq=seq)
        copies = autocast_copy_bytes(m, precision=config.trainer.precision)
    in_head = loss_bytes if m.has_seq else 0.0  # a language model's analytic head counts the loss (mlp's not)
    hidden, vocab = m.hidden_size, m.vocab_size or 0
    cross = 2 if config.trainer.precision == "bf16" else 4  # bf16 runs send bf16 between stages
    counted = model_layer_costs(m, microbatch=1, seq=seq, tflops=1.0)  # FLOPs and parameters, not times
    model_flops, recompute_flops = cluster.flop_counts(counted) if not sleep else (0.0, 0.0)
    return Workload(layers, seq, hidden * cross, StateBytes.adamw("fp32"), p.w_keep,
                    input_bytes_per_token=8.0 if m.has_seq else None,  # token ids (int64) into layer 0
                    first_stage_bytes_per_token=hidden * 4.0 if m.has_seq else None,  # fp32 parameters' embedding
                    first_stage_activation_ratio=first_stage, hidden=hidden,
                    recompute_modules=tuple(config.trainer.recompute_modules),
                    vocab=vocab, value_bytes=cross,
                    tp_replicated_bytes_per_token=TP_REPLICATED.get(m.family, 0) * hidden * cross,
                    loss_grad_bytes_per_token=8.0 * vocab if m.has_seq else 0.0,
                    loss_bytes_per_token=loss_bytes, weight_copy_bytes=tuple(copies),
                    fsdp_casts=config.parallel.param_dtype not in (None, "bfloat16"), tied=tied_layers(m),
                    sharded_layers=sharded, model_flops_per_token=model_flops,
                    recompute_flops_per_token=recompute_flops, params=float(sum(c.params for c in counted)))


def measuring(config: Config) -> bool:
    """Whether this process times the layers (partition=profile or plan.calibrate) instead of costing
    them by FLOPs: under torchrun / slurm only rank 0 does (execution.measures_here)."""
    if not (config.partition.name == "profile" or calibrating(config)):
        return False
    from pipetrain.execution import measures_here

    return measures_here(config)


def calibrating(config: Config) -> bool:
    """plan.calibrate, its null resolved: on for schedule=auto (or plan.run) training on CPU ranks
    started here, where the run is this machine's; mode=plan may plan for another cluster, and
    mode=simulate starts no process."""
    p = config.plan
    if p.calibrate is not None:
        return p.calibrate
    if not (config.schedule.name == AUTO or p.run) or config.mode is not Mode.train or config.cluster.name != "local":
        return False
    from pipetrain.execution import run_device

    return run_device(config) == "cpu"


# CUDA context (~0.5 GB) + NCCL buffers of a few communicators: plan.gpu_overhead_gb's null on CUDA
GPU_OVERHEAD_GB = 1.5


def gpu_overhead_gb(config: Config) -> float:
    """plan.gpu_overhead_gb, its null resolved: GPU_OVERHEAD_GB where the ranks train on CUDA
    (trainer.device; auto as this machine resolves it, except for model=sleep, whose plan imports no
    torch and counts auto as CPU), else 0."""
    p, t = config.plan, config.trainer
    if p.gpu_overhead_gb is not None:
        return p.gpu_overhead_gb
    if t.device == "auto" and isinstance(config.model, SleepModelConfig):
        return 0.0
    from pipetrain.execution import run_device

    return GPU_OVERHEAD_GB if run_device(config) == "cuda" else 0.0


def device(config: Config) -> Device:
    p = config.plan
    return Device(p.memory_budget_gb, gpu_overhead_gb=gpu_overhead_gb(config), p2p_gbs=p.p2p_gbs,
                  **cluster.device_fields(config),
                  p2p_latency_ms=config.sim.comm_ms if p.p2p_latency_ms is None else p.p2p_latency_ms,
                  dp_gbs=p.dp_gbs or config.cluster.dp_bandwidth_gbs, tp_gbs=config.cluster.tp_bandwidth_gbs,
                  ep_gbs=config.cluster.ep_bandwidth_gbs, cp_gbs=config.cluster.cp_bandwidth_gbs,
                  cp_rotate=config.parallel.cp_rotate, fb_overlap=fb_overlap(config), 
                  margin=p.margin, action_overhead_ms=p.action_overhead_ms, layer_overhead_ms=p.layer_overhead_ms,
                  reduce_latency_ms=p.reduce_latency_ms, step_overhead_ms=p.step_overhead_ms,
                  tp_latency_ms=p.tp_latency_ms,
                  lookahead=config.pipeline.p2p_lookahead, reduce_dtype=config.parallel.reduce_dtype,
                  p2p_transport=config.pipeline.p2p_transport)


def fb_overlap(config: Config) -> str:
    """pipeline.fb_overlap for the planner's rows: auto resolved to off where the ranks train on CUDA (the
    run's interleaver is CPU-only so far: runtime/overlap.py)."""
    mode = config.pipeline.fb_overlap
    if mode != "auto":
        return mode
    from pipetrain.execution import run_device

    return mode if run_device(config) == "cpu" else "off"


def assumptions(config: Config) -> str:
    """One line of what the plan's numbers rest on: the world, the budget, the batch, where the
    layers' times come from, and the links, so a table of GPU-speed predictions is not read as this
    machine's (or the reverse)."""
    p, m = config.plan, config.model
    d = device(config)
    seq = f" x {config.data.seq_len} tokens" if m.has_seq else ""
    if isinstance(m, SleepModelConfig):
        times = "the sleep model's f/b/w_ms"
    elif measuring(config):
        times = "measured on this machine"
    elif cluster.on_device(config):
        times = cluster.describe(config)
    else:
        times = f"FLOPs at {p.tflops or config.sim.tflops:g} TFLOP/s ({'plan' if p.tflops else 'sim'}.tflops)"
    fixed = f" (of which {d.gpu_overhead_gb:g} GB fixed per GPU, plan.gpu_overhead_gb)" if d.gpu_overhead_gb else ""
    links = cluster.links_text(config) if cluster.on_device(config) else (
        f"p2p {d.p2p_gbs:g} GB/s + {d.p2p_latency_ms:g} ms, dp {d.dp_gbs:g} GB/s, tp {d.tp_gbs:g} GB/s"
        f"{moe_and_cp_links(config, d)}")
    return (f"plan: {m.name}, {world_size(config)} devices x {p.memory_budget_gb:g} GB{fixed}, batch "
            f"{p.global_batch or config.data.batch_size}{seq}; layer times: {times}; links: {links}"
            f"{cpu_activations(config)}")


def moe_and_cp_links(config: Config, d: Device) -> str:
    """The expert-parallel and context-parallel links, where the plan searches those degrees."""
    ep = f", ep {d.ep_gbs:g} GB/s" if config.model.moe_config is not None else ""
    return ep + (f", cp {d.cp_gbs:g} GB/s ({d.cp_rotate})" if max(config.plan.cp) > 1 else "")


def cpu_activations(config: Config) -> str:
    """A note where bf16 activations measured on this CPU stand for a CUDA run's: CUDA autocast runs
    layer_norm (and softmax, log_softmax) in fp32 where CPU autocast keeps bf16 inputs in bf16, so a
    LayerNorm model's later stages save more on the GPU than these numbers say."""
    if config.trainer.precision != "bf16" or not measuring(config) or gpu_overhead_gb(config) == 0:
        return ""
    from pipetrain.execution import profile_device

    if profile_device(config) != "cpu":
        return ""
    return "; bf16 activations: this CPU's (CUDA autocast keeps layer_norm / softmax in fp32)"


def plan_candidates(config: Config, *, shard_first: bool = False) -> list[Candidate]:
    """The plan's space; `shard_first` (cluster.shard_first): FSDP2 rows, and the replicated ones beside them."""
    p = config.plan
    names = p.schedules or registry.names()
    for n in names:
        registry.get(n)  # an unknown name fails with the list of choices
    check_tp(config)
    part = plan_partitions(config)
    space = dict(world=world_size(config), global_batch=p.global_batch or config.data.batch_size,
                 num_layers=config.model.num_layers, schedules=names, microbatch_sizes=p.microbatch_sizes,
                 virtual_stages=p.virtual_stages, pp_degrees=p.pp, max_microbatches=p.max_microbatches,
                 tp_degrees=tp_degrees(config), cp_degrees=cp_degrees(config))
    rest = dict(recompute=p.recompute, recompute_partial=p.recompute_partial, recompute_selective=p.recompute_selective,
                partitions=part, sequence_parallel=p.sequence_parallel, ep_degrees=ep_degrees(config),
                experts_whole=config.model.moe_config is not None)
    cands = candidates(**space, **rest, dp_shard=bool(p.dp_shard) or shard_first)
    if shard_first:
        cands += [c for c in candidates(**space, **rest, dp_shard=False) if c.dp > 1 and not c.dp_shard]
    if not cands:
        raise ValueError(f"the plan space is empty for world {space['world']} and global batch "
                         f"{space['global_batch']}: {why_empty(**space)}")
    return cands


def plan_partitions(config: Config) -> list[str]:
    """The planner's strategies to cut by: plan.partitions, or the configured partition's (manual: balanced)."""
    names = config.plan.partitions
    if not names:
        return [PARTITIONS.get(config.partition.name, "balanced")]
    if "profile" in names and config.partition.name != "profile" and not calibrating(config):
        raise ValueError("plan.partitions lists profile (cut by measured time) but the plan costs layers by "
                         "FLOPs: set partition=profile so it measures them, or drop profile from plan.partitions")
    return [PARTITIONS[n] for n in names]


def plan_rows(config: Config, run_dir: Path, console: Console) -> tuple[Config, list[Row], dict[str, Any]]:
    """The ranked rows and what was searched; under plan.calibrate first the two short runs of
    planner/measure.py (at the microbatch size of the uncalibrated plan's best row), then the plan
    searched with their overheads: the returned config carries them, plan.json's `calibration` too."""
    if not calibrating(config):
        return (config, *make_rows(config))
    from pipetrain.planner.measure import calibrate, calibrated

    rows, _ = make_rows(config)
    mbs = rows[0].candidate.microbatch_size if rows and rows[0].feasible else min(config.plan.microbatch_sizes)
    cal = calibrate(config, workload(config), world=world_size(config), mbs=mbs,
                    partition=PARTITIONS.get(config.partition.name, "balanced"),
                    row_config=lambda c: apply_row(config, Row(c)), run_dir=run_dir,
                    note=lambda text: console.print(text, markup=False, highlight=False))
    console.print("plan.calibrate: " + ", ".join(f"plan.{k}={v:g}" for k, v in cal.items()), markup=False,
                  highlight=False)
    config = calibrated(config, cal)
    rows, meta = make_rows(config)
    return config, rows, {**meta, "calibration": cal}


def make_rows(config: Config) -> tuple[list[Row], dict[str, Any]]:
    """The ranked rows and what was searched."""
    config, given = cluster.planned_config(config), config
    p, work = config.plan, workload(config)
    start = time.perf_counter()
    note = "\n".join(filter(None, [cluster.planned_note(given, config), cluster.shard_first(config, work.params,
                                                                                           work.state)]))
    shard = "FSDP2" in note
    cands = plan_candidates(config, shard_first=shard)
    rows = search(work, device(config), cands, objective=p.objective, time_limit_s=p.time_limit_s, prune=p.prune)
    if shard:  # replicated rows only where they fit
        rows = [r for r in rows if r.feasible or r.candidate.dp_shard or r.candidate.dp == 1]
    meta = {"world_size": world_size(config), "memory_gb": p.memory_budget_gb, "device": p.device,
            **({"note": note} if note else {}),
            "global_batch": p.global_batch or config.data.batch_size, "model": config.model.name,
            "objective": p.objective, "candidates": len(cands),
            "merged": len(cands) - len(rows),  # candidates whose partition strategies cut alike (one_candidate_per_cut)
            "simulated": sum(r.pred_step_ms is not None for r in rows),
            "feasible": sum(r.feasible for r in rows), "elapsed_s": round(time.perf_counter() - start, 3)}
    return rows, meta


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ms(x: Optional[float]) -> str:
    """A time in ms with a tenth's precision, or three significant digits below 1 ms (a tiny model at
    GPU speed: 0.0712, not 0.1); 0 below a microsecond (a difference of two makespans)."""
    if x is None:
        return "-"
    return "0" if abs(x) < 1e-3 else format(x, ".1f" if abs(x) >= 1 else ".3g")


def table(rows: list[Row], *, top: int) -> Table:
    t = Table(title="plan: best first (feasible rows first)", header_style="bold")
    cuts = len({r.candidate.partition for r in rows}) > 1  # plan.partitions searched: show each row's
    cols = ["#", "layout", "schedule", "v", "M", "mbs", "recompute", *(["partition"] if cuts else []), "step ms",
            "tokens/s", "TFLOP/s", "MFU %", "bubble %", "peak GB (rank)", "comm ms", "note"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("layout", "schedule", "partition", "note") else "right")
    user_name = {planner: user for user, planner in PARTITIONS.items()}
    for i, r in enumerate(rows[:top]):
        c, peak = r.candidate, r.peak
        t.add_row(str(i + 1), c.layout, c.schedule, str(c.v), str(c.microbatches), str(c.microbatch_size),
                  c.recompute_label, *([user_name.get(c.partition, c.partition)] if cuts else []),
                  _ms(r.pred_step_ms), _fmt(r.tokens_per_s, ",.0f"), _fmt(r.tflops_per_device, ".3g"),
                  _fmt(None if r.mfu is None else 100 * r.mfu, ".1f"),
                  _fmt(None if r.bubble is None else 100 * r.bubble, ".1f"),
                  "-" if peak is None else f"{r.pred_peak_gb:.3g} ({peak.rank})", _ms(r.exposed_comm_ms),
                  ("" if r.feasible else r.reason) + (f" budget {r.memory_budget:g}" if r.memory_budget else ""))
    return t


def write(rows: list[Row], meta: dict[str, Any], run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [{"rank": i + 1, **r.to_json()} for i, r in enumerate(rows)]
    (run_dir / PLAN_FILE).write_text(json.dumps({**meta, "rows": records}, indent=2) + "\n")
    with open(run_dir / PLAN_CSV, "w", newline="") as fh:
        out = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        out.writeheader()
        out.writerows(records)


def run_plan(config: Config, run_dir: Path, console: Console | None = None) -> dict[str, Any]:
    console = console or Console(width=None if Console().is_terminal else 160)
    console.print(assumptions(cluster.planned_config(config)), markup=False, highlight=False)
    config, rows, meta = plan_rows(config, run_dir, console)
    if meta.get("note"):
        console.print(meta["note"], markup=False, highlight=False)
    write(rows, meta, run_dir)
    console.print(table(rows, top=config.plan.top))
    merged = f" ({meta['merged']} cut alike by another partition: one row each)" if meta["merged"] else ""
    console.print(f"{meta['candidates']} candidates{merged}, {meta['simulated']} rows simulated, "
                  f"{meta['feasible']} feasible "
                  f"under {meta['memory_gb']:g} GB per device, in {meta['elapsed_s']:.1f} s -> "
                  f"{run_dir / PLAN_FILE}, {PLAN_CSV}", markup=False, highlight=False)
    return {**meta, "best": rows[0].to_json() if rows else None}


def apply_row(config: Config, row: Row) -> Config:
    """The config that trains `row`: its layout, schedule, microbatching, recompute and partition."""
    c = row.candidate
    dp_rep, dp_shard = (1, c.dp) if c.dp_shard else (c.dp, 1)
    schedule = dataclasses.replace(config.schedule, name=c.schedule, virtual_stages=c.v,
                                   memory_budget=row.budgets, w_keep=config.plan.w_keep)
    return dataclasses.replace(
        config, schedule=schedule,
        pipeline=dataclasses.replace(config.pipeline, degree=c.pp, microbatches=c.microbatches),
        parallel=dataclasses.replace(config.parallel, dp_replicate=dp_rep, dp_shard=dp_shard, tp=c.tp,
                                     sequence_parallel=c.sequence_parallel, ep=c.ep, etp=c.etp, cp=c.cp,
                                     cp_rotate=config.parallel.cp_rotate if c.cp > 1 else "allgather"),
        data=dataclasses.replace(config.data, batch_size=c.dp * c.microbatches * c.microbatch_size),
        trainer=dataclasses.replace(config.trainer, activation_checkpointing=False, recompute=row_recompute(config, c),
                                    recompute_stages=None if c.recompute_ranks is None else sorted(
                                        c.recompute_stages(registry.placement_for(c.schedule, c.pp, c.v)))),
        partition=dataclasses.replace(config.partition, boundaries=None,
                                      name="profile" if c.partition == "time" else c.partition))


def row_recompute(config: Config, c: Candidate) -> str:
    """A row's trainer.recompute: the row's mode where it recomputes, else none."""
    return c.recompute_mode
