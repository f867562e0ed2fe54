"""The executor's own CPU per action, beside torch.distributed.pipelining's, on compute-free stages.

Stages: pipetrain's MLP model (models/mlp.py) with one layer per stage, width --width (4) and one
sample per microbatch: a Linear + tanh on a (1, 4) tensor is a few microseconds, so what a step
costs is the runtime around it (P2P posting and waiting, dispatch, autograd engine calls,
bookkeeping). Both sides run the same stages, the same cut, the same placement and the same
microbatches, built by bench/pipelining_vs_torch.py's `PipetrainSide` / `TorchSide` (torch's
PipelineStage wraps the very StageModule pipetrain runs) and checked equal (loss and gradients
after one step from identical weights) before any timing.

The floor (`FloorSide`, every schedule): the same actions in the same order on copies of the same
stages, in a plain loop that makes only the calls any executor must make (a blocking gloo recv
when an input or gradient comes from another rank, the stage, the loss, one autograd engine call,
a gloo send, the sends waited for at the step's end, DualPipe's mirrored copies summed), checked
equal to pipetrain's side too. pipetrain / floor is what the executor adds (its P2P plan posting
ahead, buffers, timeouts, the loss all-reduce of the non-finite check, bookkeeping), measured side
by side on the same machine in the same run: a bound on it holds on a slow machine as on a fast
one, where a bound in microseconds does not (issue 31's 100 us: the floor alone costs 90-120 us
per action at P=4, M=8 on a 2-core machine running a fifth slower than usual).

Schedules: every built-in pipetrain schedule at P in --degrees (2,4) and M in --microbatches
(8,32); the torch column for the six torch can run the same way (pipelining_vs_torch.TORCH_SCHEDULES;
torch 2.13 also has ScheduleInterleavedZeroBubble, which has no pipetrain counterpart).

What is counted: a step is `train_step` on pipetrain's side (executor step, its closing loss
all-reduce, GradSync), unmeasured as the trainer's unlogged steps run (`Executor.measure`;
--measured: as its logged steps, with timings, comm events and activation bytes recorded), and
`schedule.step` + GradSync on torch's (which records nothing); CPU is the rank process's
`time.process_time` delta (main thread + gloo's threads) and, beside it, the main thread's
`time.thread_time`. Actions are each side's own compute actions on that rank: F, B (input
grad; torch's I), W, BW (full backward; torch's B), an F&B pair (torch's OVERLAP_F_B) counting
as its two parts; sends, receives and REDUCE_GRAD are not counted. us/action = median over the
measured steps of the step's CPU / actions, per rank, and for all ranks together (sum of CPU /
sum of actions). Measurement: one spawn of P gloo ranks (1 thread each) per P; 1 warm-up step
per side after the check; then --rounds rounds, each running every case as --steps rounds of
steps, one per side, the sides' order reversed every other time; each step after a barrier (not
timed).

Phase split (--profile-p 2, --profile-m 32): for each case at that P and M, each rank attaches py-spy to
itself (`py-spy record --native --format raw`, --rate Hz), runs about --profile-s seconds of
steps of one side, and each on-CPU sample of the main thread is put in one phase by its
innermost Python frame that a rule names (PHASES below): p2p_issue, p2p_wait, dispatch,
autograd, module (stage forward + loss), bookkeeping (clock marks, timing records, saved-bytes
hooks, step setup), collectives (loss all-reduce, GradSync), harness (this bench's zero_grad /
barrier: left out of the split). Shares are of the main thread's samples that py-spy counts as
active; on a loaded machine that includes some time blocked in a gloo wait (py-spy's samples then
add up to more seconds than the thread's CPU), so p2p_wait is an upper bound and the split is
also given without it. The top frames by self samples are kept.

Usage: python bench/executor_overhead.py [--quick] [--rounds 3] [--steps 3] [--degrees 2,4]
         [--microbatches 8,32] [--schedules gpipe,1f1b,...] [--measured] [--no-profile] [--out FILE] [--note TEXT]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipelining_vs_torch import (TORCH_SCHEDULES, PipetrainSide, TorchSide, cpu_model, gather_object,
                                 pipetrain_schedule, pipetrain_source, verify)
from pipetrain.launch.local import spawn_local
from pipetrain.models.mlp import MLPModel
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.schedules import registry
from pipetrain.runtime.sync import GradSync
from pipetrain.schedules.ir import Op

SIDES = ("pipetrain", "torch", "floor")
TORCH_COMPUTE = {"F", "I", "W", "B"}  # torch's compute action types (an OVERLAP_F_B holds two)
TOP_FRAMES = 15  # frames kept per profile, by self samples

# (phase, path fragment, function names or None for any): the first rule matching a sample's
# innermost Python frame wins, walking outwards past frames no rule names.
PHASES: list[tuple[str, str, frozenset[str] | None]] = [
    ("p2p_wait", "pipetrain/runtime/comm.py", frozenset({"receive", "_wait", "_wait_group", "finish"})),
    ("p2p_issue", "pipetrain/runtime/comm.py", None),
    ("p2p_wait", "pipelining/schedules.py", frozenset({"_wait_batch_p2p"})),
    ("p2p_issue", "pipelining/schedules.py", frozenset({"_batch_p2p", "_sorted_batch_p2p"})),
    ("p2p_issue", "pipelining/stage.py", frozenset({"get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops",
                                                    "get_bwd_send_ops", "_get_recv_ops", "get_local_bwd_output"})),
    ("p2p_issue", "distributed_c10d.py", frozenset({"isend", "irecv", "batch_isend_irecv", "P2POp", "__new__"})),
    ("collectives", "distributed_c10d.py", frozenset({"all_reduce", "all_gather"})),  # not barrier: the harness's
    ("collectives", "pipetrain/runtime/sync.py", None),
    ("collectives", "pipetrain/runtime/executor.py", frozenset({"_mean_loss"})),
    ("bookkeeping", "pipetrain/runtime/executor.py", frozenset({"_reset"})),
    ("bookkeeping", "pipetrain/runtime/recorder.py", None),
    ("bookkeeping", "pipetrain/runtime/clock.py", None),
    ("bookkeeping", "pipetrain/runtime/step_result.py", None),
    ("bookkeeping", "pipetrain/runtime/batch.py", None),
    ("bookkeeping", "pipetrain/metrics/", None),
    ("bookkeeping", "pipelining/microbatch.py", None),
    ("autograd", "pipetrain/runtime/backward.py", None),
    ("autograd", "pipelining/_backward.py", None),
    ("autograd", "torch/autograd/", None),
    ("autograd", "torch/_tensor.py", frozenset({"backward"})),
    ("module", "pipetrain/models/", None),
    ("module", "torch/nn/", None),
    ("harness", "bench/", None),
    ("dispatch", "pipetrain/", None),
    ("dispatch", "torch/distributed/pipelining/", None),
]


def frame_phase(path: str, func: str) -> str | None:
    func = func.rsplit(".", 1)[-1]  # py-spy names methods by qualified name: "P2P._wait"
    for phase, fragment, funcs in PHASES:
        if fragment in path and (funcs is None or func in funcs):
            return phase
    return None


def parse_frame(frame: str) -> tuple[str, str] | None:
    """'func (path/file.py:12)' -> (func, path); None for a native frame."""
    func, _, rest = frame.partition(" (")
    path = rest.rsplit(":", 1)[0] if ".py:" in rest else ""
    return (func, path) if path else None


def short_frame(func: str, path: str, line: str) -> str:
    """A frame named relative to the repo or to site-packages: no absolute paths in the JSON."""
    for marker in ("site-packages/", "/work/main/"):
        path = path.split(marker, 1)[-1]
    return f"{func} ({path}:{line})"


def classify(raw: str) -> tuple[collections.Counter, collections.Counter]:
    """py-spy raw (collapsed) stacks -> (samples per phase, self samples per innermost Python frame)."""
    phases: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        py = [(f, parse_frame(f)) for f in stack.split(";")]
        py = [(f, p) for f, p in py if p is not None]
        phase = next((ph for _, (func, path) in reversed(py) if (ph := frame_phase(path, func))), "other")
        phases[phase] += int(count)
        if py:
            text, (func, path) = py[-1]
            frames[short_frame(func, path, text.rsplit(":", 1)[-1].rstrip(")"))] += int(count)
    return phases, frames


# ---- on the ranks ---------------------------------------------------------------------------


class FloorSide:
    """The floor: the calls any executor of this schedule must make, in a plain loop with nothing
    else. Per action of the rank's order: F receives its input (a blocking gloo recv, or the
    stage before it on this rank), runs the stage (and the loss on the last: its backward starts from 1/M) and
    posts the send of its output; B / BW receive the output's gradient the same way, run one
    autograd engine call (B: into the stage input only, keeping the graph; W: into the weights;
    BW: both) and post the send of the input's gradient; every send is waited for at the end
    of the step, then DualPipe's mirrored copies are summed (GradSync, as torch's side does). It
    runs copies of pipetrain's StageModules. What it leaves out is what an executor adds: a P2P
    plan, posting ahead, buffers, timeouts and error text, the mean loss all-reduce of the
    non-finite check, bookkeeping. Checked equal (loss and gradients) to pipetrain's side before any
    timing."""

    name = "floor"

    def __init__(self, pt: PipetrainSide, sched, rank: int, specs) -> None:
        self.pl, self.rank, self.M = sched.placement, rank, sched.num_microbatches
        self.order = list(sched.actions(rank))
        # Copies of pipetrain's stages (same weights): so that the two are checked equal by their gradients
        self.stages = {s: copy.deepcopy(mod) for s, mod in pt.stages.items()}
        self.mbs, self.specs = pt.mbs, specs  # specs: stage -> its input's TensorSpec
        self.params = {s: [p for p in mod.parameters() if p.requires_grad] for s, mod in self.stages.items()}
        self.pg = dist.group.WORLD
        self.sync = GradSync(self.stages)  # DualPipe's mirrored chunks summed (nothing for the others), as torch's side
        self.losses: list[torch.Tensor] = []
        self.seed = torch.ones(()) / self.M  # a loss's backward starts from 1/M: gradients are the mean

    def zero_grad(self) -> None:
        for mod in self.stages.values():
            mod.zero_grad(set_to_none=True)

    # A message is (kind, b, m): kind 0 the activation into stage b, kind 1 the gradient of b's input.
    def _tag(self, kind: int, b: int, m: int) -> int:
        return (kind * self.pl.num_stages + b) * self.M + m

    def _get(self, local: dict, kind: int, b: int, src: int, m: int) -> torch.Tensor:
        if self.pl.rank_of(src) == self.rank:
            return local.pop((kind, b, m))
        buf = self.specs[b].empty()
        self.pg.recv([buf], self.pl.rank_of(src), self._tag(kind, b, m)).wait()
        return buf

    def _put(self, local: dict, sends: list, kind: int, b: int, dst: int, m: int, t: torch.Tensor) -> None:
        if self.pl.rank_of(dst) == self.rank:
            local[(kind, b, m)] = t
        else:
            sends.append((t, self.pg.send([t], self.pl.rank_of(dst), self._tag(kind, b, m))))

    def step(self) -> None:
        pl, local, sends, live = self.pl, {}, [], {}
        self.losses, self._grads = [], {}
        for a in self.order:
            s, m = a.stage, a.microbatch
            prev, nxt = pl.prev_stage(s), pl.next_stage(s)
            if a.op is Op.F:
                x = self.mbs[m][0] if prev is None else self._get(local, 0, s, prev, m)
                x = x.detach().requires_grad_(True)  # as pipetrain's F: the first stage's B computes it too
                out = self.stages[s](x)
                if nxt is None:
                    out = self.stages[s].loss(out, self.mbs[m][1])
                    self.losses.append(out.detach())
                else:
                    self._put(local, sends, 0, nxt, nxt, m, out.detach())
                live[(s, m)] = (x, out)
                continue
            x, out = live[(s, m)]
            if a.op is Op.W:
                torch.autograd.backward(out, self._grads.pop((s, m)), inputs=self.params[s])
                del live[(s, m)]
                continue
            g = self.seed if nxt is None else self._get(local, 1, nxt, nxt, m)
            if a.op is Op.B:
                self._grads[(s, m)] = g
                torch.autograd.backward(out, g, inputs=[x], retain_graph=True)
            else:
                torch.autograd.backward(out, g)
                del live[(s, m)]
            if prev is not None:
                self._put(local, sends, 1, s, prev, m, x.grad)
        for _, work in sends:
            work.wait()
        self.sync.sync()

    def loss(self) -> float:
        buf = torch.zeros(2, dtype=torch.float64)
        if self.losses:
            buf[0], buf[1] = float(sum(self.losses)), len(self.losses)
        dist.all_reduce(buf)
        return float(buf[0] / buf[1])


def torch_actions(side: TorchSide, rank: int) -> int:
    order = side.schedule.pipeline_order[rank]
    return sum(1 for a in order if a is not None for p in (a.sub_actions or (a,))
               if p.computation_type.value in TORCH_COMPUTE)


def cpu_step(side) -> tuple[float, float]:
    """One step after a barrier: this rank's (process CPU s, main-thread CPU s)."""
    side.zero_grad()
    dist.barrier()
    p0, t0 = time.process_time(), time.thread_time()
    side.step()
    return time.process_time() - p0, time.thread_time() - t0


def build_case(name: str, P: int, M: int, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both sides (torch's where it has the schedule) of one (schedule, M), checked equal, warmed up."""
    case = argparse.Namespace(**{**vars(args), "degree": P, "microbatches": M, "batch": M, "seq": 1})
    sched = pipetrain_schedule(name, case)
    n = sched.placement.num_chunks
    model = MLPModel(n_layer=n, d_in=args.width, d_hidden=args.width, d_out=args.width, seed=0)
    bounds = list(uniform_bounds(n, n))  # one layer per stage
    batch = model.example_batch(microbatch=M, generator=torch.Generator().manual_seed(1))
    sides: dict[str, Any] = {"pipetrain": PipetrainSide(model, bounds, sched, rank, batch, case)}
    sides["pipetrain"].rp.executor.measure = args.measured
    actions = {"pipetrain": sum(1 for _ in sched.actions(rank))}
    if name in TORCH_SCHEDULES:
        sides["torch"] = TorchSide(model, bounds, sched, name, rank, batch, case)
        actions["torch"] = torch_actions(sides["torch"], rank)
        verify(sides["pipetrain"], sides["torch"], name, case)
    specs, pl = model.boundary_specs(microbatch=1), sched.placement
    sides["floor"] = FloorSide(sides["pipetrain"], sched, rank,
                               {s: specs[bounds[pl.chunk_of(s)].start] for s in range(pl.num_stages)})
    actions["floor"] = actions["pipetrain"]
    verify(sides["pipetrain"], sides["floor"], name, case)
    for side in sides.values():
        cpu_step(side)  # warm-up
    return {"sides": sides, "actions": actions}


def profile_side(side, steps: int, rank: int, work: Path, tag: str, rate: int) -> dict[str, Any]:
    """Run `steps` steps under py-spy attached to this rank; its phase and frame counts."""
    path = work / f"{tag}.r{rank}.txt"
    cmd = [shutil.which("py-spy") or "py-spy", "record", "--pid", str(os.getpid()), "--rate", str(rate),
           "--format", "raw", "--native", "--output", str(path)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attach
    dist.barrier()
    for _ in range(steps):
        cpu_step(side)
    dist.barrier()
    spy.send_signal(signal.SIGINT)
    _, err = spy.communicate(timeout=60)
    if not path.exists():
        raise RuntimeError(f"py-spy wrote no profile (rc {spy.returncode}): {err.strip()[-300:]}; "
                           f"run with --no-profile, or give this user ptrace rights")
    phases, frames = classify(path.read_text())
    return {"steps": steps, "phases": dict(phases), "top_frames": dict(frames.most_common(TOP_FRAMES))}


def rank_main(rank: int, world: int, out: Path, args: argparse.Namespace) -> None:
    P, t0 = world, time.perf_counter()
    cases = {(n, M): build_case(n, P, M, rank, args) for n in args.schedule_list for M in args.m_list}
    if rank == 0:
        print(f"[P={P}] {len(cases)} cases built, checked equal to torch and warmed up in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    raw: dict[str, Any] = {}
    for key, c in cases.items():
        raw[f"{key[0]}|{key[1]}"] = {s: {"actions": c["actions"][s], "cpu_s": [], "thread_s": []} for s in c["sides"]}
    for rnd in range(args.rounds):
        for i, (key, c) in enumerate(cases.items()):
            names = list(c["sides"])
            for k in range(args.steps):
                for s in (names if (k + rnd + i) % 2 == 0 else names[::-1]):
                    cpu, thr = cpu_step(c["sides"][s])
                    rec = raw[f"{key[0]}|{key[1]}"][s]
                    rec["cpu_s"].append(cpu)
                    rec["thread_s"].append(thr)
        if rank == 0:
            print(f"[P={P}] round {rnd + 1}/{args.rounds} done at {time.perf_counter() - t0:.0f} s", flush=True)
    profiles: dict[str, Any] = {}
    if args.profile and P == args.profile_p:
        for (name, M), c in cases.items():
            if M != args.profile_m:
                continue
            for s, side in c["sides"].items():
                if s == "floor":  # a reference: its calls are the phases themselves
                    continue
                est = statistics.median(raw[f"{name}|{M}"][s]["thread_s"]) * 3  # slowed by sampling and sharing
                steps = torch.tensor([max(3, math.ceil(args.profile_s / max(est, 1e-3)))])
                dist.broadcast(steps, 0)
                profiles[f"{name}|{M}|{s}"] = profile_side(side, int(steps), rank, out, f"{name}.{M}.{s}", args.rate)
    everything = gather_object({"raw": raw, "profiles": profiles}, world)
    if rank == 0:
        print(f"[P={P}] profiles done at {time.perf_counter() - t0:.0f} s", flush=True)
        (out / f"raw_P{P}.json").write_text(json.dumps(everything))
    for c in cases.values():
        c["sides"]["pipetrain"].rp.close()


# ---- report ---------------------------------------------------------------------------------


def side_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One side of one case, from every rank's record: us/action per rank and for all ranks together,
    of the main thread (the executor's own work) and of the process (plus gloo's socket threads)."""
    actions = [r["actions"] for r in per_rank]
    steps = range(len(per_rank[0]["cpu_s"]))
    ranks = list(range(len(per_rank)))

    def us(key: str, ranks: list[int]) -> float:
        return statistics.median(sum(per_rank[r][key][k] for r in ranks) / sum(actions[r] for r in ranks)
                                 for k in steps) * 1e6

    return {"us_per_action_main_thread": us("thread_s", ranks), "us_per_action_process": us("cpu_s", ranks),
            "us_per_action_main_thread_per_rank": [us("thread_s", [r]) for r in ranks],
            "us_per_action_process_per_rank": [us("cpu_s", [r]) for r in ranks],
            "cpu_ms_per_step_main_thread_per_rank": [statistics.median(p["thread_s"]) * 1e3 for p in per_rank],
            "cpu_ms_per_step_process_per_rank": [statistics.median(p["cpu_s"]) * 1e3 for p in per_rank],
            "actions_per_rank": actions, "steps_measured": len(steps)}


def phase_split(profs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank and over all ranks: share of the main thread's samples per phase (harness left out),
    with and without p2p_wait (see the module docstring: a blocked wait can be sampled as active)."""
    def split(counts: dict[str, int]) -> dict[str, Any]:
        kept = {k: v for k, v in counts.items() if k != "harness"}
        busy = {k: v for k, v in kept.items() if k != "p2p_wait"}
        return {"samples": sum(kept.values()),
                "share": {k: round(v / (sum(kept.values()) or 1), 4) for k, v in sorted(kept.items())},
                "share_without_p2p_wait": {k: round(v / (sum(busy.values()) or 1), 4) for k, v in sorted(busy.items())}}

    merged: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()
    for p in profs:
        merged.update(p["phases"])
        frames.update(p["top_frames"])
    return {"all_ranks": split(dict(merged)), "per_rank": [split(p["phases"]) for p in profs],
            "steps_per_rank": profs[0]["steps"], "top_frames": dict(frames.most_common(TOP_FRAMES))}


def summarize(P: int, gathered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key in gathered[0]["raw"]:
        name, M = key.split("|")
        row: dict[str, Any] = {"schedule": name, "degree": P, "microbatches": int(M),
                               "torch_class": TORCH_SCHEDULES.get(name)}
        for s in gathered[0]["raw"][key]:
            row[s] = side_stats([g["raw"][key][s] for g in gathered])
            prof = [g["profiles"].get(f"{key}|{s}") for g in gathered]
            if all(prof):
                row[s]["phases"] = phase_split(prof)
        for other in ("torch", "floor"):
            if other in row:
                for kind in ("main_thread", "process"):
                    key = f"us_per_action_{kind}"
                    row[f"pipetrain_over_{other}_{kind}"] = row["pipetrain"][key] / row[other][key]
        rows.append(row)
    return rows


def overall(rows: list[dict[str, Any]], target_us: float, floor_bound: float,
            floor_median_bound: float) -> dict[str, Any]:
    both = [r for r in rows if "torch" in r]
    out: dict[str, Any] = {"target_us_per_action": target_us, "floor_bound": floor_bound,
                           "floor_median_bound": floor_median_bound, "rows": len(rows), "rows_with_torch": len(both)}
    for kind in ("main_thread", "process"):
        key, ratio = f"us_per_action_{kind}", f"pipetrain_over_torch_{kind}"
        pt = [r["pipetrain"][key] for r in rows]
        out[kind] = {"pipetrain_us_per_action_median": statistics.median(pt), "pipetrain_us_per_action_max": max(pt),
                     "torch_us_per_action_median": statistics.median(r["torch"][key] for r in both) if both else None,
                     "pipetrain_over_torch_median": statistics.median(r[ratio] for r in both) if both else None,
                     "pipetrain_over_torch_max": max((r[ratio] for r in both), default=None),
                     "rows_pipetrain_at_most_torch": sum(r[ratio] <= 1.0 for r in both),
                     "rows_pipetrain_at_most_target": sum(x <= target_us for x in pt)}
        over_floor = [r[f"pipetrain_over_floor_{kind}"] for r in rows if "floor" in r]
        if over_floor:
            out[kind].update({
                "floor_us_per_action_median": statistics.median(r["floor"][key] for r in rows if "floor" in r),
                "floor_us_per_action_max": max(r["floor"][key] for r in rows if "floor" in r),
                "pipetrain_over_floor_median": statistics.median(over_floor),
                "pipetrain_over_floor_max": max(over_floor),
                "rows_pipetrain_within_floor_bound": sum(x <= floor_bound for x in over_floor),
                "floor_bounds_met": (max(over_floor) <= floor_bound
                                     and statistics.median(over_floor) <= floor_median_bound)})
    for side in SIDES:
        for key in ("share", "share_without_p2p_wait"):
            splits = [r[side]["phases"]["all_ranks"][key] for r in rows if side in r and "phases" in r[side]]
            total: collections.Counter = collections.Counter()
            for split in splits:
                total.update(split)
            out[f"{side}_phase_{key}_mean"] = ({k: round(v / len(splits), 3) for k, v in sorted(total.items())}
                                               if splits else None)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    nan = float("nan")
    print(f"\n{'schedule':>16} {'P':>2} {'M':>3} | main thread us/act: {'pipetrain':>9} {'torch':>7} {'ratio':>6} "
          f"{'floor':>7} {'ratio':>6} | process us/act: {'pipetrain':>9} {'torch':>7} {'ratio':>6} | "
          f"main thread per rank pipetrain/torch")
    for r in rows:
        pt, th, fl = r["pipetrain"], r.get("torch", {}), r.get("floor", {})
        per_rank = "  ".join(f"{a:4.0f}/{b:<4.0f}" for a, b in zip(
            pt["us_per_action_main_thread_per_rank"], th.get("us_per_action_main_thread_per_rank", [nan] * 8)))
        print(f"{r['schedule']:>16} {r['degree']:>2} {r['microbatches']:>3} | {'':>19} "
              f"{pt['us_per_action_main_thread']:9.1f} {th.get('us_per_action_main_thread', nan):7.1f} "
              f"{r.get('pipetrain_over_torch_main_thread', nan):6.3f} {fl.get('us_per_action_main_thread', nan):7.1f} "
              f"{r.get('pipetrain_over_floor_main_thread', nan):6.3f} | {'':>14} {pt['us_per_action_process']:9.1f} "
              f"{th.get('us_per_action_process', nan):7.1f} "
              f"{r.get('pipetrain_over_torch_process', nan):6.3f} | {per_rank}")
    print("(CPU per compute action, median over steps, all ranks together; ratio = pipetrain / torch or floor, "
          "lower is cheaper; process = main thread + gloo's socket threads)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda t: [int(x) for x in t.split(",") if x]  # noqa: E731
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 2 pairs, M=8 only, short profiles")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="pairs of steps (one per side) per case per round")
    ap.add_argument("--degrees", type=ints, default=[2, 4], help="pipeline ranks P")
    ap.add_argument("--microbatches", type=ints, default=[8, 32], help="M")
    ap.add_argument("--schedules", default=",".join(registry.names()))
    ap.add_argument("--virtual-stages", type=int, default=2, help="stages per rank of interleaved_1f1b, looped_bfs")
    ap.add_argument("--width", type=int, default=4, help="the MLP's width: every boundary tensor is (1, width)")
    ap.add_argument("--p2p-timeout-s", type=float, default=300.0)
    ap.add_argument("--p2p-lookahead", type=int, default=1)
    ap.add_argument("--loss-tol", type=float, default=1e-6)
    ap.add_argument("--grad-tol", type=float, default=1e-6)
    ap.add_argument("--measured", action="store_true",
                    help="pipetrain's steps measured (timings, comm events, activation bytes: the trainer's logged "
                         "steps) instead of unmeasured (its other steps; torch's steps measure nothing)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the py-spy phase split")
    ap.add_argument("--profile-p", type=int, default=2, help="P of the profiled cases")
    ap.add_argument("--profile-m", type=int, default=32, help="M of the profiled cases")
    ap.add_argument("--profile-s", type=float, default=0.6, help="about this many seconds of steps per profiled case")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--target-us", type=float, default=100.0, help="issue 31's bound on pipetrain's us/action")
    ap.add_argument("--floor-bound", type=float, default=1.35,
                    help="the bound held instead of --target-us: pipetrain's us/action over the floor's in the same "
                         "run, in every row")
    ap.add_argument("--floor-median-bound", type=float, default=1.15,
                    help="and over the rows' median of pipetrain / floor")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "executor_overhead.json"))
    ap.add_argument("--note", default="", help="free text stored in the JSON")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.microbatches, args.profile_m, args.profile_s = 1, 2, [8], 8, 0.2
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    args.m_list = args.microbatches
    for P in args.degrees:  # fail here, not inside the ranks
        for M in args.m_list:
            for s in args.schedule_list:
                pipetrain_schedule(s, argparse.Namespace(**{**vars(args), "degree": P, "microbatches": M}))
    if args.profile and (args.profile_m not in args.m_list or args.profile_p not in args.degrees):
        ap.error(f"--profile-p {args.profile_p} / --profile-m {args.profile_m} must be among --degrees "
                 f"{args.degrees} / --microbatches {args.m_list}")
    if args.profile and shutil.which("py-spy") is None:
        ap.error("py-spy is not on PATH: pip install py-spy, or pass --no-profile")
    load0, t0 = os.getloadavg(), time.perf_counter()
    rows = []
    for P in args.degrees:
        work = Path(tempfile.mkdtemp(prefix="pipetrain-overhead-"))
        spawn_local(rank_main, P, work, args)
        rows += summarize(P, json.loads((work / f"raw_P{P}.json").read_text()))
    load1 = os.getloadavg()
    cpus = os.cpu_count() or 1
    config = {k: v for k, v in vars(args).items() if k not in ("out", "note", "schedule_list", "m_list")}
    doc = {"python": platform.python_version(), "torch": torch.__version__, "cpus": cpus, "cpu": cpu_model(),
           "pipetrain_source": pipetrain_source(), "note": args.note,
           "machine_load": {"loadavg_1m_before": load0[0], "loadavg_1m_after": load1[0],
                            "shared_or_noisy": max(load0[0], load1[0]) > 0.5 * cpus},
           "wall_s": round(time.perf_counter() - t0, 1), "config": config, "threads_per_rank": 1, "backend": "gloo",
           "model": f"MLPModel, one Linear({args.width},{args.width}) (+tanh but the last) per stage, microbatch 1",
           "counted_actions": "F, B (torch I), W, BW (torch B); an F&B pair (torch OVERLAP_F_B) as its two parts",
           "summary": overall(rows, args.target_us, args.floor_bound, args.floor_median_bound), "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print_table(rows)
    print(json.dumps(doc["summary"], indent=1))
    print(f"wall {doc['wall_s']} s; wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
