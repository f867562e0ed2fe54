"""pipetrain vs torch.distributed.pipelining: the same pipeline, step for step, on CPU ranks.

Both sides get the same GPT-2 (same seed, so the same initial weights), the same stage cut
(pipetrain's layers, embedding + blocks + head, split into the schedule's number of chunks
by pipetrain's balanced partition, --partition; with equal layer counts the V schedules'
rank 0 would hold the two cheap ends, embedding and head, and rank 1 the four middle blocks), the
same stage -> rank placement (asserted against torch's own mapping: loop = stage s on rank s % P, V
= rank r holds stages r and 2P-1-r), the same data (one global batch; torch chunks it with
`tensor_split`, pipetrain gets the same chunks as its microbatches) and the same-named schedule:

    gpipe            ScheduleGPipe              interleaved_1f1b  ScheduleInterleaved1F1B
    1f1b             Schedule1F1B               looped_bfs        ScheduleLoopedBFS
    zbv              ScheduleZBVZeroBubble      dualpipev         ScheduleDualPipeV

torch's PipelineStage wraps the very module pipetrain runs (`build_stage(...)`: the last
stage returns logits) and its loss_fn is that stage's loss (`GPT2.loss_fn`). One step on
either side is forward + backward of all M microbatches + the gradient sync of the tied
embedding / head (pipetrain: inside `RankPipeline.train_step`; torch: a `GradSync` over
the torch stage modules after `schedule.step`). Gradients are zeroed between steps and no
optimizer runs, so every step does identical work. torch divides gradients by M after the
step (scale_grads=True) where pipetrain divides each microbatch's loss by M: before any
timing, one step from identical weights and data must give the same loss (|diff| <=
--loss-tol) and the same gradients (max |diff| <= --grad-tol) on both sides, else the run
fails.

Measurement: ONE spawn of P gloo ranks (1 thread each, glibc told to keep freed memory);
for each round, the single-process baseline first (rank 0 runs it in subprocesses while
the other ranks wait: the whole model, the whole global batch in one forward + backward,
at 1 and at 2 threads; and at 1 thread in M microbatches with gradient accumulation, the work
of the pipeline's ranks at their matmul shapes, alone and as P such processes at once: the sum of
the P concurrent runs' tokens/s is what P one-thread ranks reach with no bubble and free
communication, the ceiling of any schedule here. P times the lone run overstates it: P busy cores
share the caches and memory bandwidth and run at a lower boost clock than one, 3-4% on the 2-core
machine; both figures are reported), then for each
schedule both sides in PAIRED steps: 1 warm-up step per side, then --steps pairs, each pair one
step of either side back to back, the side that goes first alternating from pair to pair (and
by round), so a slow moment of the shared
machine lands on both sides alike; each step after a barrier. A step's time is the slowest
rank's (all_reduce MAX), CPU seconds per step are each rank's process_time delta.
tokens/s = batch * seq / step time; a round's tokens/s is the median over its steps, the
reported one the median over rounds (and so the ratio). Last, pipetrain's
peak receive-buffer bytes per stage in one step at M=8 and at M=64 (--recv-scaling-m, same
microbatch size): its point-to-point plan posts receives just in time, so they must not
grow with M (torch allocates a buffer per microbatch).

Usage: python bench/pipelining_vs_torch.py [--rounds 5] [--steps 4] [--degree 2] [--microbatches 8]
         [--batch 16] [--seq 128] [--schedules gpipe,1f1b,...] [--p2p-lookahead 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.launch.forkserver import CPU_MALLOC_ENV
from pipetrain.launch.local import spawn_local
from pipetrain.models.gpt2 import GPT2
from pipetrain.models.split import build_stage
from pipetrain.partition.strategies import min_max_bounds
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.train.pipeline import Transport, build_rank_pipeline
from pipetrain.runtime.sync import GradSync
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Schedule

# pipetrain name -> torch.distributed.pipelining class name
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SIDES = ("pipetrain", "torch")


# ---- shared setup -------------------------------------------------------------------------


def build_model(args: argparse.Namespace) -> GPT2:
    torch.manual_seed(args.seed)
    return GPT2(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                block_size=args.block_size, dropout=0.0)


def global_batch(model: GPT2, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed + 1)
    return model.example_batch(microbatch=args.batch, seq=args.seq, generator=g)


def stage_cut(model: GPT2, sched: Schedule, args: argparse.Namespace) -> list[range]:
    """The layers of each chunk, the same on both sides: pipetrain's `balanced` partition (exact
    min-max over the analytic per-layer F+B+W times) by default, or `uniform` layer counts."""
    chunks = sched.placement.num_chunks
    if args.partition == "uniform":
        return list(uniform_bounds(len(model.layers), chunks))
    costs = model.cost_model(microbatch=args.batch // args.microbatches, seq=args.seq, tflops=1.0)
    return list(min_max_bounds([c.total_ms for c in costs], chunks))


def pipetrain_schedule(name: str, args: argparse.Namespace) -> Schedule:
    fixed = registry.get(name).fixed_stages_per_rank
    return registry.build(name, args.degree, args.microbatches, fixed or args.virtual_stages)


def planner_choice(args: argparse.Namespace) -> dict[str, Any]:
    """What pipetrain picks for the bench's model when it chooses (issue #31): `schedule=auto
    partition=profile` at pipeline.degree=P on P CPU ranks, the bench's global batch and sequence.
    The planner times the layers here (partition=profile), trains its two short calibration runs
    (plan.calibrate, on by default for local CPU ranks) and ranks every schedule, M and microbatch
    size; its first row is what `pipetrain schedule=auto` would train. Returns the row (schedule,
    v, M, microbatch size, cut, predicted tokens/s)."""
    from rich.console import Console

    from pipetrain.compose import compose_config
    from pipetrain.planner.cmd import plan_rows

    config = compose_config([
        "model=gpt2-tiny", f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}",
        f"model.n_head={args.n_head}", f"model.vocab_size={args.vocab}", f"model.block_size={args.block_size}",
        f"data.batch_size={args.batch}", f"data.seq_len={args.seq}", f"pipeline.degree={args.degree}",
        "schedule=auto", "partition=profile", f"plan.world_size={args.degree}", f"plan.pp=[{args.degree}]",
        "plan.partitions=[profile]", "trainer.device=cpu", f"trainer.seed={args.seed}"])
    with tempfile.TemporaryDirectory(prefix="pipetrain-bench-plan-") as run_dir:
        config, rows, meta = plan_rows(config, Path(run_dir), Console(quiet=True))
    if not rows or not rows[0].feasible:
        raise SystemExit(f"the planner found no feasible row ({rows[0].reason if rows else 'no candidates'})")
    row, c = rows[0], rows[0].candidate
    if c.recompute or c.tp != 1 or c.dp != 1:
        raise SystemExit(f"the planner picked {c.layout} recompute={c.recompute}: the bench runs pipelines only")
    return {"schedule": c.schedule, "v": c.v, "microbatches": c.microbatches, "microbatch_size": c.microbatch_size,
            "cut": [list(r) for r in row.cut], "pred_step_ms": row.pred_step_ms,
            "pred_tokens_per_s": row.tokens_per_s, "calibration": meta.get("calibration"),
            "candidates": meta["candidates"]}


def planner_args(args: argparse.Namespace) -> argparse.Namespace:
    """The bench's arguments at the planner's microbatching (its M of the same global batch)."""
    return argparse.Namespace(**{**vars(args), "microbatches": args.planner_row["microbatches"]})


# ---- the two sides ------------------------------------------------------------------------


class PipetrainSide:
    name = "pipetrain"

    def __init__(self, model: GPT2, bounds: list[range], sched: Schedule, rank: int, batch, args) -> None:
        self.rp = build_rank_pipeline(model, bounds, sched, rank, microbatch_size=args.batch // args.microbatches,
                                      seq_len=args.seq, transport=Transport(
                                          timeout_s=args.p2p_timeout_s, lookahead=args.p2p_lookahead))
        self.rp.executor.measure = False  # records nothing, as torch's side (the trainer's unlogged steps)
        idx, tgt = batch
        M = args.microbatches  # the same chunks torch's default TensorChunkSpec(0) makes
        self.mbs = list(zip(idx.tensor_split(M), tgt.tensor_split(M)))
        self.stages: dict[int, nn.Module] = self.rp.stages
        self._loss: Optional[float] = None

    def zero_grad(self) -> None:
        for mod in self.stages.values():
            mod.zero_grad(set_to_none=True)

    def step(self) -> None:
        self._loss = self.rp.train_step(self.mbs).loss  # includes GradSync.sync()

    def loss(self) -> float:
        """Mean loss of the last step (already all-reduced by the executor)."""
        assert self._loss is not None
        return self._loss


class TorchSide:
    name = "torch"

    def __init__(self, model: GPT2, bounds: list[range], sched: Schedule, name: str, rank: int, batch, args) -> None:
        from torch.distributed import pipelining as pp

        pl = sched.placement
        S, M = pl.num_stages, args.microbatches
        mb = args.batch // M
        self.stages = {s: build_stage(model, bounds[pl.chunk_of(s)], stage_id=s) for s in pl.stages_of(rank)}
        # Static metadata: example input / output of ONE microbatch per stage, so torch skips its
        # runtime shape inference (a hidden forward + backward plus object send/recv on the first
        # step). requires_grad matters here: it is copied into the receive buffers' metadata, so a
        # float activation must say True or no input gradient flows back; the int64 token ids of
        # the first stage must say False.
        specs = model.boundary_specs(microbatch=mb, seq=args.seq)
        self.pstages = []
        for s in sorted(self.stages):
            rng = bounds[pl.chunk_of(s)]
            inp, out = specs[rng.start].empty(), specs[rng.stop].empty()
            inp.requires_grad_(inp.is_floating_point())
            out.requires_grad_(out.is_floating_point())
            self.pstages.append(pp.PipelineStage(self.stages[s], s, S, torch.device("cpu"),
                                                 input_args=(inp,), output_args=(out,)))
        cls = getattr(pp, TORCH_SCHEDULES[name])
        # loss_fn on EVERY rank: torch only runs backwards where the schedule has a loss_fn.
        # GPT2.loss_fn is exactly what the last StageModule.loss calls (mean CE of a microbatch);
        # scale_grads=True divides the summed gradients by M afterwards.
        loss_fn = type(model).loss_fn
        if issubclass(cls, pp.schedules.PipelineScheduleSingle):
            if len(self.pstages) != 1:
                raise ValueError(f"{cls.__name__} takes one stage per rank, pipetrain's {name} "
                                 f"gives {len(self.pstages)}")
            self.schedule = cls(self.pstages[0], M, loss_fn=loss_fn, scale_grads=True)
            mapping = self.pstages[0].stage_index_to_group_rank
        else:
            self.schedule = cls(self.pstages, M, loss_fn=loss_fn, scale_grads=True)
            mapping = self.schedule.stage_index_to_group_rank
        want = {s: pl.rank_of(s) for s in range(S)}
        if dict(mapping) != want:
            raise AssertionError(f"{name}: torch places stages {dict(mapping)}, pipetrain {want} ({pl.describe()})")
        self.placement = {str(s): r for s, r in sorted(want.items())}
        self.has_first = 0 in self.stages
        self.has_last = any(pl.next_stage(s) is None for s in self.stages)
        self.idx, self.tgt = batch
        self.sync = GradSync(self.stages)  # collective: tied wte / lm_head across stages
        self._losses: list[torch.Tensor] = []

    def zero_grad(self) -> None:
        for mod in self.stages.values():
            mod.zero_grad(set_to_none=True)

    def step(self) -> None:
        args = (self.idx,) if self.has_first else ()
        losses: Optional[list] = [] if self.has_last else None
        self.schedule.step(*args, target=self.tgt if self.has_last else None, losses=losses,
                           return_outputs=False)
        self.sync.sync()
        self._losses = losses or []

    def loss(self) -> float:
        """Mean loss over the microbatches of the last step (collective: only one rank has them)."""
        buf = torch.zeros(2, dtype=torch.float64)
        if self._losses:
            buf[0] = sum(float(x.detach()) for x in self._losses)
            buf[1] = len(self._losses)
        dist.all_reduce(buf)
        return float(buf[0] / buf[1])


def recv_buffer_scaling(rank: int, world: int, args: argparse.Namespace) -> dict[str, dict[str, dict[str, int]]]:
    """Peak receive-buffer bytes per stage of one pipetrain step, at each M of --recv-scaling-m
    (same microbatch size, so M=64 is 8x the batch of M=8): {schedule: {M: {stage: bytes}}}.
    The plan posts receives just in time, so this should not grow with M."""
    mb = args.batch // args.microbatches
    out: dict[str, dict[str, dict[str, int]]] = {}
    for name in args.schedule_list:
        out[name] = {}
        for M in args.recv_scaling_m:
            scaled = argparse.Namespace(**{**vars(args), "microbatches": M, "batch": M * mb})
            sched = pipetrain_schedule(name, scaled)
            model = build_model(args)
            bounds = stage_cut(model, sched, args)
            rp = build_rank_pipeline(model, bounds, sched, rank, microbatch_size=mb, seq_len=args.seq,
                                     transport=Transport(timeout_s=args.p2p_timeout_s, lookahead=args.p2p_lookahead))
            idx, tgt = global_batch(model, scaled)
            res = rp.train_step(list(zip(idx.tensor_split(M), tgt.tensor_split(M))))
            merged: dict[str, int] = {}
            for peaks in gather_object(res.peak_recv_buffer_bytes, world):
                merged.update({str(stage): int(b) for stage, b in peaks.items()})
            out[name][str(M)] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
    return out


# ---- measurement on the ranks -------------------------------------------------------------


def timed_step(side) -> tuple[float, float]:
    """One step after a barrier: (slowest rank's seconds, this rank's CPU seconds)."""
    side.zero_grad()
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    side.step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = torch.tensor([wall], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
    return t.item(), cpu


def run_pairs(sides: dict, steps: int, first: int) -> dict[str, tuple[list[float], list[float]]]:
    """1 warm-up step per side, then `steps` pairs of steps, one of each side, the side going
    first alternating per pair (`first` picks the first pair's); per side (walls, cpus)."""
    names = list(sides)
    for n in names:
        timed_step(sides[n])
    out: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for k in range(steps):
        order = names if (k + first) % 2 == 0 else names[::-1]
        for n in order:
            wall, cpu = timed_step(sides[n])
            out[n][0].append(wall)
            out[n][1].append(cpu)
    return out


def gather_floats(values: list[float], world: int) -> list[list[float]]:
    """Every rank's list (same length on all ranks), rank order."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def verify(pt: PipetrainSide, th: Any, name: str, args) -> dict:
    """One step on each side from identical weights and data: same loss, same gradients. `th`:
    torch's side, or executor_overhead.py's floor (anything with stages, zero_grad, step, loss, name)."""
    for side in (pt, th):
        side.zero_grad()
        dist.barrier()
        side.step()
    loss_pt, loss_th = pt.loss(), th.loss()
    diff = torch.zeros(2, dtype=torch.float64)  # max |grad_pt - grad_torch|, max |grad|
    missing = []
    for s, mod in pt.stages.items():
        theirs = dict(th.stages[s].named_parameters())
        for n, p in mod.named_parameters():
            q = theirs[n]
            if (p.grad is None) != (q.grad is None):
                missing.append(f"stage {s} {n}: pipetrain grad {'None' if p.grad is None else 'set'}, "
                               f"{th.name} {'None' if q.grad is None else 'set'}")
                continue
            if p.grad is not None:
                diff[0] = max(diff[0], (p.grad - q.grad).abs().max().double())
                diff[1] = max(diff[1], p.grad.abs().max().double())
    flag = torch.tensor([float(len(missing))])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    loss_diff = abs(loss_pt - loss_th)
    if missing or flag.item() or loss_diff > args.loss_tol or diff[0].item() > args.grad_tol:
        raise AssertionError(
            f"{name}: pipetrain and {th.name} disagree after one step from identical weights and data: "
            f"loss {loss_pt:.8f} vs {loss_th:.8f} (|diff| {loss_diff:.2e}, tol {args.loss_tol:.0e}), "
            f"max |grad diff| {diff[0].item():.2e} (tol {args.grad_tol:.0e}, max |grad| {diff[1].item():.2e})"
            + (f"; {'; '.join(missing[:4])}" if missing else ""))
    return {"loss_pipetrain": loss_pt, f"loss_{th.name}": loss_th, "loss_abs_diff": loss_diff,
            "grad_max_abs_diff": diff[0].item(), "grad_max_abs": diff[1].item()}


# baseline runs: (threads, microbatches); 1 = the whole global batch at once
CONCURRENT = "1_microbatched_concurrent"  # P one-thread microbatched processes at once: the ceiling
BASELINES = {"1": (1, False), "2": (2, False), "1_microbatched": (1, True), CONCURRENT: (1, True)}
PLANNER_BASELINE = "1_planner_microbatched"  # the ceiling at the planner's microbatch size, when it picks another M
PLANNER_CONCURRENT = "1_planner_microbatched_concurrent"


def run_baseline(key: str, args: argparse.Namespace) -> dict:
    """The whole model in a fresh process (rank 0 calls this), as BASELINES[key] says (PLANNER_*: 1 thread in
    the planner's M microbatches); the *_concurrent keys run P such processes at once and sum their tokens/s."""
    threads, micro = BASELINES.get(key, (1, True))
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop} | CPU_MALLOC_ENV
    m = ["--microbatches", str(args.planner_row["microbatches"])] if key.startswith("1_planner") else []
    cmd = [sys.executable, os.path.abspath(__file__), *args.argv, *m, "--baseline-child", "--threads", str(threads),
           *(["--accumulate"] if micro else [])]
    n = args.degree if key.endswith("_concurrent") else 1
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    runs = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)
        runs.append(json.loads(out.strip().splitlines()[-1]))
    if n == 1:
        return runs[0]
    return {**runs[0], "processes": n, "tokens_per_s": sum(r["tokens_per_s"] for r in runs),
            "tokens_per_s_each": [r["tokens_per_s"] for r in runs], "step_s": [r["step_s"] for r in runs]}


def rank_main(rank: int, world: int, out: Path, args: argparse.Namespace) -> None:
    model = build_model(args)
    batch = global_batch(model, args)
    tokens = args.batch * args.seq
    names = args.schedule_list
    pipes: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {"schedules": {}, "baseline": {key: [] for key in BASELINES}}
    for name in names:  # build both sides once per schedule (fresh torch stages each), verify them
        sched = pipetrain_schedule(name, args)
        bounds = stage_cut(model, sched, args)
        pt = PipetrainSide(model, bounds, sched, rank, batch, args)
        th = TorchSide(model, bounds, sched, name, rank, batch, args)
        check = verify(pt, th, name, args)
        pipes[name] = {"pipetrain": pt, "torch": th}
        raw["schedules"][name] = {
            "bounds": [[r.start, r.stop] for r in bounds], "placement": th.placement, "check": check,
            **{s: {"step_s": [], "cpu_s": [[] for _ in range(world)]} for s in SIDES}}
        if rank == 0:
            print(f"[verify] {name:>16}: loss {check['loss_pipetrain']:.6f} vs {check['loss_torch']:.6f} "
                  f"(diff {check['loss_abs_diff']:.1e}), max |grad diff| {check['grad_max_abs_diff']:.1e}",
                  flush=True)
    if args.planner_row is not None:  # pipetrain's own choice, and torch on the same cut where it has the schedule
        pr, pa = args.planner_row, planner_args(args)
        sched = registry.build(pr["schedule"], args.degree, pr["microbatches"], pr["v"])
        bounds = [range(a, b) for a, b in pr["cut"]]
        sides: dict[str, Any] = {"pipetrain": PipetrainSide(model, bounds, sched, rank, batch, pa)}
        if pr["schedule"] in TORCH_SCHEDULES:
            sides["torch"] = TorchSide(model, bounds, sched, pr["schedule"], rank, batch, pa)
            raw["planner_check"] = verify(sides["pipetrain"], sides["torch"], "planner", pa)
        pipes["planner"] = sides
        raw["planner"] = {s: {"step_s": [], "cpu_s": [[] for _ in range(world)]} for s in sides}
    for rnd in range(args.rounds):
        if rank == 0:  # the baseline, between rounds; the other ranks wait in the barrier
            keys = list(BASELINES)
            if args.planner_row is not None and args.planner_row["microbatches"] != args.microbatches:
                keys += [PLANNER_BASELINE, PLANNER_CONCURRENT]
            for key in keys if rnd % 2 == 0 else reversed(keys):
                raw["baseline"].setdefault(key, []).append(run_baseline(key, args))
        dist.barrier()
        for name in pipes:
            measured = run_pairs(pipes[name], args.steps, first=rnd)
            for side_name, (walls, cpus) in measured.items():
                rec = (raw["planner"] if name == "planner" else raw["schedules"][name])[side_name]
                rec["step_s"].append(walls)
                for r, c in enumerate(gather_floats(cpus, world)):
                    rec["cpu_s"][r].extend(c)
            if rank == 0 and name != "planner":
                rs = raw["schedules"][name]
                pt_s, th_s = (statistics.median(rs[s]["step_s"][-1]) for s in SIDES)
                print(f"[round {rnd}] {name:>16}: pipetrain {tokens / pt_s:8.0f} tok/s  torch "
                      f"{tokens / th_s:8.0f} tok/s  ratio {th_s / pt_s:.3f}", flush=True)
    raw["recv_scaling"] = recv_buffer_scaling(rank, world, args)
    if rank == 0:
        (out / "raw.json").write_text(json.dumps(raw))


def gather_object(obj: Any, world: int) -> list[Any]:
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, obj)
    return objs


# ---- single-process baseline (child process) ------------------------------------------------


def baseline_child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)  # before any work
    model = build_model(args)
    idx, tgt = global_batch(model, args)
    parts = args.microbatches if args.accumulate else 1  # the pipeline's chunks, as torch cuts them
    chunks = list(zip(idx.tensor_split(parts), tgt.tensor_split(parts)))
    times = []
    for i in range(args.steps + 1):  # the first step warms up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        total = 0.0
        for x, y in chunks:
            loss = model.loss(model(x), y) / parts
            loss.backward()
            total += loss.item()
        if i:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    print(json.dumps({"threads": args.threads, "microbatches": parts, "step_s": times,
                      "tokens_per_s": args.batch * args.seq / step, "loss": total}))


# ---- report --------------------------------------------------------------------------------


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    tokens = args.batch * args.seq
    base = {}
    for th in BASELINES:
        runs = raw["baseline"][th]
        base[th] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                    "tokens_per_s_rounds": [r["tokens_per_s"] for r in runs], "loss": runs[0]["loss"]}
    base2 = base["2"]["tokens_per_s"]
    rows = {}
    for name, rs in raw["schedules"].items():
        row: dict[str, Any] = {"torch_class": TORCH_SCHEDULES[name], "bounds": rs["bounds"],
                               "placement": rs["placement"]}
        per_round = {}
        for side in SIDES:
            rounds = [tokens / statistics.median(w) for w in rs[side]["step_s"]]
            per_round[side] = rounds
            row[side] = {
                "tokens_per_s": statistics.median(rounds),
                "tokens_per_s_rounds": rounds,
                "step_s_rounds": rs[side]["step_s"],
                "cpu_s_per_step_per_rank": [statistics.median(c) for c in rs[side]["cpu_s"]],
                "loss": rs["check"][f"loss_{side}"],
            }
        ratios = [a / b for a, b in zip(per_round["pipetrain"], per_round["torch"])]
        row["ratio_rounds"] = ratios
        row["ratio_median"] = statistics.median(ratios)
        row["loss_abs_diff"] = rs["check"]["loss_abs_diff"]
        row["loss_diff_vs_baseline"] = abs(rs["check"]["loss_pipetrain"] - base["2"]["loss"])
        row["grad_max_abs_diff"] = rs["check"]["grad_max_abs_diff"]
        row["grad_max_abs"] = rs["check"]["grad_max_abs"]
        row["pipetrain_over_baseline_2t"] = row["pipetrain"]["tokens_per_s"] / base2
        rows[name] = row

    def ratio(name: str) -> Optional[float]:
        return rows[name]["ratio_median"] if name in rows else None

    best = max(rows, key=lambda n: rows[n]["pipetrain"]["tokens_per_s"])
    # P one-thread ranks at the microbatch's shapes, no bubble, free communication: P such processes at once
    ceiling = base[CONCURRENT]["tokens_per_s"]
    solo = args.degree * base["1_microbatched"]["tokens_per_s"]  # P times one alone: 3-4% above it here
    worst = min(rows, key=lambda n: rows[n]["ratio_median"])
    summary = {
        "min_ratio": rows[worst]["ratio_median"], "min_ratio_schedule": worst,
        "zbv_ratio": ratio("zbv"), "dualpipev_ratio": ratio("dualpipev"),
        "pipetrain_zbv_over_1f1b": (rows["zbv"]["pipetrain"]["tokens_per_s"] / rows["1f1b"]["pipetrain"]["tokens_per_s"]
                                    if "zbv" in rows and "1f1b" in rows else None),
        "best_pipetrain_schedule": best,
        "best_pipetrain_over_baseline_2t": rows[best]["pipetrain_over_baseline_2t"],
        "ceiling_tokens_per_s": ceiling, "ceiling_solo_x_p_tokens_per_s": solo, "ceiling_over_solo_x_p": ceiling / solo,
        "ceiling_over_baseline_2t": ceiling / base2,
        "best_pipetrain_over_ceiling": rows[best]["pipetrain"]["tokens_per_s"] / ceiling,
        "best_pipetrain_over_ceiling_solo_x_p": rows[best]["pipetrain"]["tokens_per_s"] / solo,
    }
    if raw.get("planner"):
        pr = dict(args.planner_row)
        for side, rec in raw["planner"].items():
            rounds = [tokens / statistics.median(w) for w in rec["step_s"]]
            pr[side] = {"tokens_per_s": statistics.median(rounds), "tokens_per_s_rounds": rounds,
                        "cpu_s_per_step_per_rank": [statistics.median(c) for c in rec["cpu_s"]]}
        pr["pipetrain_over_ceiling"] = pr["pipetrain"]["tokens_per_s"] / ceiling
        pr["pipetrain_over_ceiling_solo_x_p"] = pr["pipetrain"]["tokens_per_s"] / solo
        if raw["baseline"].get(PLANNER_CONCURRENT):  # P one-thread ranks at the planner's microbatch shapes
            own = statistics.median(r["tokens_per_s"] for r in raw["baseline"][PLANNER_CONCURRENT])
            own_solo = args.degree * statistics.median(r["tokens_per_s"] for r in raw["baseline"][PLANNER_BASELINE])
            pr["ceiling_at_its_microbatches_tokens_per_s"] = own
            pr["pipetrain_over_ceiling_at_its_microbatches"] = pr["pipetrain"]["tokens_per_s"] / own
            pr["pipetrain_over_ceiling_solo_x_p_at_its_microbatches"] = pr["pipetrain"]["tokens_per_s"] / own_solo
        if "torch" in pr:
            pr["ratio_median"] = statistics.median(a / b for a, b in zip(pr["pipetrain"]["tokens_per_s_rounds"],
                                                                          pr["torch"]["tokens_per_s_rounds"]))
            pr["check"] = raw.get("planner_check")
        summary["planner_row"] = pr
        summary["planner_over_ceiling"] = pr["pipetrain_over_ceiling"]
    lo, hi = (str(m) for m in (min(args.recv_scaling_m), max(args.recv_scaling_m)))
    scaling = {}
    for name, per_m in raw["recv_scaling"].items():
        ratio_by_stage = {st: per_m[hi][st] / per_m[lo][st] for st in per_m[lo] if per_m[lo][st]}
        scaling[name] = {"peak_recv_buffer_bytes_per_stage": per_m,
                         f"ratio_M{hi}_over_M{lo}_max_over_stages": max(ratio_by_stage.values(), default=None)}
    summary["recv_buffer_ratio_max"] = max(
        (v[f"ratio_M{hi}_over_M{lo}_max_over_stages"] for v in scaling.values()
         if v[f"ratio_M{hi}_over_M{lo}_max_over_stages"] is not None), default=None)
    return {"baseline": {"tokens_per_s_1thread": base["1"]["tokens_per_s"], "tokens_per_s_2threads": base2,
                         "tokens_per_s_1thread_microbatched": base["1_microbatched"]["tokens_per_s"],
                         f"tokens_per_s_1thread_microbatched_{args.degree}_at_once": ceiling,
                         "runs": base}, "schedules": rows, "recv_buffer_scaling": scaling, "summary": summary}


def print_table(res: dict, args: argparse.Namespace) -> None:
    P = args.degree
    cpu_hdr = "  ".join(f"{'cpu r' + str(r) + ' pt/th':>15}" for r in range(P))
    print(f"\n{'schedule':>16} {'pipetrain':>10} {'torch':>10} {'ratio':>6} {'rounds':>20}  {cpu_hdr}"
          f"  {'loss diff':>9} {'grad diff':>9} {'pt/base2':>8}")
    for name, r in res["schedules"].items():
        rounds = ",".join(f"{x:.2f}" for x in r["ratio_rounds"])
        cpus = "  ".join(f"{a:7.3f}/{b:<7.3f}" for a, b in zip(r["pipetrain"]["cpu_s_per_step_per_rank"],
                                                            r["torch"]["cpu_s_per_step_per_rank"]))
        print(f"{name:>16} {r['pipetrain']['tokens_per_s']:10.0f} {r['torch']['tokens_per_s']:10.0f} "
              f"{r['ratio_median']:6.3f} {rounds:>20}  {cpus}  {r['loss_abs_diff']:9.1e} "
              f"{r['grad_max_abs_diff']:9.1e} {r['pipetrain_over_baseline_2t']:8.3f}")
    b = res["baseline"]
    print(f"\nsingle process, whole batch: {b['tokens_per_s_1thread']:.0f} tok/s at 1 thread, "
          f"{b['tokens_per_s_2threads']:.0f} tok/s at 2 threads; {b['tokens_per_s_1thread_microbatched']:.0f} tok/s "
          f"at 1 thread in {args.microbatches} microbatches")
    s = res["summary"]
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"min ratio {s['min_ratio']:.3f} ({s['min_ratio_schedule']}); zbv ratio {fmt(s['zbv_ratio'])}; "
          f"dualpipev ratio {fmt(s['dualpipev_ratio'])}; pipetrain zbv/1f1b {fmt(s['pipetrain_zbv_over_1f1b'])}; "
          f"best pipetrain ({s['best_pipetrain_schedule']}) / 2-thread baseline "
          f"{s['best_pipetrain_over_baseline_2t']:.3f}; ceiling ({args.degree} 1-thread microbatched runs at once, "
          f"{s['ceiling_tokens_per_s']:.0f} tok/s, {s['ceiling_over_solo_x_p']:.3f} of {args.degree} x one alone) / "
          f"2-thread baseline {s['ceiling_over_baseline_2t']:.3f}, "
          f"best / ceiling {s['best_pipetrain_over_ceiling']:.3f} "
          f"(/ {args.degree} x one alone {s['best_pipetrain_over_ceiling_solo_x_p']:.3f})")
    if "planner_row" in s:
        pr = s["planner_row"]
        vs = (f", torch on the same cut {pr['torch']['tokens_per_s']:.0f} (ratio {pr['ratio_median']:.3f})"
              if "torch" in pr else "")
        print(f"planner's pick (schedule=auto partition=profile, P={args.degree}): {pr['schedule']} v={pr['v']} "
              f"M={pr['microbatches']} cut {pr['cut']}: {pr['pipetrain']['tokens_per_s']:.0f} tok/s{vs}; "
              f"/ ceiling {pr['pipetrain_over_ceiling']:.3f} (/ {args.degree} x one alone "
              f"{pr['pipetrain_over_ceiling_solo_x_p']:.3f})" + (
                  f" (/ the ceiling at its own M {pr['pipetrain_over_ceiling_at_its_microbatches']:.3f})"
                  if "pipetrain_over_ceiling_at_its_microbatches" in pr else ""))
    print("(ratio = pipetrain tok/s / torch tok/s, median over rounds; cpu = CPU s per step per rank)")


def pipetrain_source() -> dict:
    """Where the measured pipetrain came from: its path, and git HEAD / local changes if in a checkout."""
    import pipetrain

    path = Path(pipetrain.__file__).resolve().parent
    repo = Path(__file__).resolve().parents[1]  # relative to the repo when it is this checkout's
    info: dict[str, Any] = {"path": str(path.relative_to(repo)) if path.is_relative_to(repo) else path.name}
    try:
        git = ["git", "-C", str(path.parent)]
        info["git_head"] = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                                          text=True).stdout.strip()
        info["modified"] = subprocess.run([*git, "status", "--porcelain", "--", "pipetrain"], check=True,
                                          capture_output=True, text=True).stdout.split("\n")
        info["modified"] = [m.strip() for m in info["modified"] if m.strip()]
    except (OSError, subprocess.CalledProcessError):
        pass  # not a git checkout (e.g. an exported snapshot on PYTHONPATH)
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="timed pairs of steps (one per side) per schedule per round, "
                                                         "after 1 warm-up step per side")
    ap.add_argument("--degree", type=int, default=2, help="pipeline ranks P")
    ap.add_argument("--microbatches", type=int, default=8, help="M")
    ap.add_argument("--batch", type=int, default=16, help="global batch (microbatch = batch / M)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--virtual-stages", type=int, default=2, help="stages per rank of interleaved_1f1b, looped_bfs")
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedules", default=",".join(TORCH_SCHEDULES))
    ap.add_argument("--p2p-timeout-s", type=float, default=300.0, help="pipetrain's P2P wait limit")
    ap.add_argument("--p2p-lookahead", type=int, default=1,
                    help="pipetrain's pipeline.p2p_lookahead (receives posted this many actions early; on gloo "
                         "an early receive moves the transfer into gloo's socket thread during compute)")
    ap.add_argument("--partition", choices=["balanced", "uniform"], default="balanced",
                    help="stage cut for both sides: pipetrain's balanced partition or equal layer counts")
    ap.add_argument("--recv-scaling-m", type=lambda t: [int(x) for x in t.split(",")], default=[8, 64],
                    help="microbatch counts at which to measure pipetrain's peak receive-buffer bytes per stage")
    ap.add_argument("--loss-tol", type=float, default=1e-5)
    ap.add_argument("--grad-tol", type=float, default=1e-5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipelining_vs_torch.json"))
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. which pipetrain was measured)")
    ap.add_argument("--no-planner", dest="planner", action="store_false",
                    help="skip the row pipetrain picks itself (schedule=auto partition=profile at --degree)")
    ap.add_argument("--baseline-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--accumulate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.argv = sys.argv[1:]
    if args.baseline_child:
        baseline_child(args)
        return
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in args.schedule_list:
        if s not in TORCH_SCHEDULES:
            ap.error(f"--schedules: {s!r} has no torch counterpart here; choose from {', '.join(TORCH_SCHEDULES)}")
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    for s in args.schedule_list:  # fail here, not inside the ranks
        pipetrain_schedule(s, args)
    args.planner_row = planner_choice(args) if args.planner else None
    if args.planner_row is not None:
        print(f"[planner] picks {args.planner_row['schedule']} v={args.planner_row['v']} "
              f"M={args.planner_row['microbatches']} cut {args.planner_row['cut']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="pipetrain-bench-"))
    spawn_local(rank_main, args.degree, work, args)
    raw = json.loads((work / "raw.json").read_text())
    res = summarize(raw, args)
    config = {k: v for k, v in vars(args).items()
              if k not in ("argv", "baseline_child", "threads", "accumulate", "out", "note", "planner_row")}
    config["microbatch"] = args.batch // args.microbatches
    config["tokens_per_step"] = args.batch * args.seq
    config["threads_per_rank"] = 1
    config["backend"] = "gloo"
    config["malloc_env"] = CPU_MALLOC_ENV
    doc = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "cpu": cpu_model(), "pipetrain_source": pipetrain_source(), "note": args.note, "config": config, **res}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(res, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
