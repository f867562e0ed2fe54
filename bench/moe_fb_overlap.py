"""DualPipe's F&B overlap (issue #29) measured: MoE stages on real gloo, all-to-alls hidden or not.

A Llama with MoE blocks only (top-k routed experts, no shared expert, aux_free balance: no loss term) runs under
expert parallel ep=2 without FSDP, in two layouts: pp=1 x ep=2 (2 ranks, both V stages of DualPipe-V
on each) and pp=2 x ep=2 (4 ranks). The stage cut is mirrored (embedding + k blocks | k blocks | ... |
k blocks + head) so every F&B pair pairs MoE layers with MoE layers. Each EP rank routes its own
microbatches. Rows, all on the same model, ranks and data, one spawn per layout:

  dualpipev_on      pipeline.fb_overlap=on: each F&B pair's nodes interleaved (runtime/overlap.py)
  dualpipev_serial  the same nodes run serially ("overlap off": every all-to-all waited at once)
  dualpipev_off     whole stages (pipeline.fb_overlap=off, the executor before issue #29)
  1f1b              pipetrain's 1F1B, whole stages (at pp=1 one stage: the whole model per rank)
  torch_dualpipev   torch.distributed.pipelining's ScheduleDualPipeV on the same stage modules

Interleaved rounds (bench/pipelining_vs_torch.py's run_pairs: a warm-up step per row, then --steps
steps of every row back to back, the order reversed every other step and round). A step's time is the
slowest rank's; F&B ms is the rank's summed F&B pair actions (their span less P2P receive waits), the
all-to-all total / exposed the token all-to-alls the step recorded in its actions (runtime/collectives.py:
issue -> arrival, and the time blocked waiting; whole stages wait at once, so all of theirs is exposed),
also over the F&B pairs alone (what the overlap can hide: lone F, B and W actions wait for their
all-to-alls in both modes); peak activation bytes as autograd saved them.

The simulator's check: the serial row's measured per-action times (F, B, W, BW per stage) and, per MoE
layer, its nodes' times (each node timed; an all-to-all from its start to its arrival, the wait
subtracted from the node that waited) go into StageCosts(layers=...), whose F&B pairs price each MoE
layer pair as the executor runs it (schedules/fb_pairs.py chain_ms: the pair's nodes in PAIR_ORDER on
one thread, all-to-alls in flight side by side; bench/moe_fb_overlap_sim.py); simulated F&B ms and step
ms are compared with the overlap row's measured ones (`sim_*_over_measured`).

--single: issue #29's one-GPU check of the interleaver. One process, a one-rank EP group over the world (NCCL
on a GPU, gloo on CPU), so every all-to-all is the collective's copy of the same bytes, run on node mode's
communication stream on CUDA (runtime/ep_comm.py), followed by an emulated network time (EPGroup.delay_s: a GPU
sleep on that stream) of the token bytes at --net-gbs. DualPipe-V at pp=1 (both V stages on the process), the
experts as one grouped GEMM (no host sync), bf16 on the GPU. Reported besides the rows: the overlap ratio (the
share of the F&B pairs' all-to-all time hidden under compute, from CUDA events: `checks.a2a_overlap_on`, bar
0.8) and the host syncs inside the interleaved pairs under torch.cuda.set_sync_debug_mode("warn") other than
the planned one per dispatch (`checks.unplanned_host_syncs`, bar 0). Where no GPU is visible it runs the same
code on the CPU (a dry run of the check: tiny sizes, fp32, bench/results/moe_fb_overlap_single_dryrun.json).

--deterministic: the experts cost a fixed time (a sleep in forward and in backward on top of a tiny
SwiGLU) and every token all-to-all an emulated network delay (runtime/ep_comm.py EPGroup.delay_s: a
sleep until start + delay, no CPU), so the overlap's saving does not depend on the machine's load
(tests/test_moe_fb_overlap_bench.py runs it small in CI).

Usage: python bench/moe_fb_overlap.py [--layouts pp1,pp2] [--rounds 3] [--steps 3]
                                     [--deterministic | --single] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

from pipetrain.launch.local import spawn_local
from pipetrain.models.llama import Llama
from pipetrain.models.moe import Experts
from pipetrain.models.sleep_module import sleep_ms
from pipetrain.runtime.ep_comm import EPGroup, gpu_sleep

# bench/ is on sys.path: as a script, and in tests/test_moe_fb_overlap_bench.py
from moe_fb_overlap_sim import simulated, stage_costs, timed_nodes
from pipelining_vs_torch import cpu_model, gather_object, pipetrain_source, run_pairs

EP = 2
LAYOUTS = {"pp1": 1, "pp2": 2}  # name -> pipeline degree; world = pp x ep (--single: one process)
ROWS = ("dualpipev_on", "dualpipev_serial", "dualpipev_off", "1f1b", "torch_dualpipev")
# Real gloo: many routed rows (top-8 of 8 experts, 1,024 tokens per microbatch) of a narrow model
# (hidden 64, expert width 8), so the all-to-all bytes are large beside the matmuls: on the 2-core
# machine 25-33% of the serial F&B time at a load average of 3 (less under more load: compute stretches
# more than gloo's transfers). Deterministic: a tiny model whose time is the experts' sleeps and the
# delays, delay >> expert time: an MoE layer pair, serially 4 delays + 2 expert times, overlaps to about
# 2 delays + 2 expert times (two all-to-alls in flight at once): 0.56x.
REAL_GLOO = dict(microbatches=8, microbatch=8, seq=128, hidden=64, heads=4, vocab=256, experts=8, top_k=8,
                 expert_width=8, blocks_per_stage=2, delay_ms=0.0, expert_f_ms=0.0, expert_b_ms=0.0)
DETERMINISTIC = dict(microbatches=4, microbatch=2, seq=16, hidden=32, heads=4, vocab=64, experts=4, top_k=2,
                     expert_width=8, blocks_per_stage=1, delay_ms=20.0, expert_f_ms=5.0, expert_b_ms=5.0)
# --single on a GPU: attention and experts of a real size, bf16, the network at --net-gbs (delay from the bytes).
# An F&B pair hides B.combine under F.attn and B.dispatch under F.experts (PAIR_ORDER), so the token bytes at
# the emulated bandwidth are set below a forward attention's / experts' time: 4 x 512 tokens, top-2 of 8,
# hidden 1024 -> 8 MiB per all-to-all, 0.17 ms at 50 GB/s, beside ~0.3 ms of forward attention on an H100.
SINGLE_GPU = dict(microbatches=8, microbatch=4, seq=512, hidden=1024, heads=8, vocab=1024, experts=8, top_k=2,
                  expert_width=1024, blocks_per_stage=2, expert_f_ms=0.0, expert_b_ms=0.0)
SINGLE_DRYRUN = dict(microbatches=4, microbatch=2, seq=16, hidden=32, heads=4, vocab=64, experts=4, top_k=2,
                     expert_width=8, blocks_per_stage=1, expert_f_ms=0.0, expert_b_ms=0.0)
# issue #29's bars on `checks` (at most, except the simulator's: within 10% either way)
TARGETS = {"fb_ms_on_over_serial": 0.90, "fb_ms_on_over_serial_deterministic": 0.65,
           "a2a_exposed_on_over_serial": 0.5, "peak_activation_on_over_serial": 1.10,
           "a2a_share_of_serial_fb_min": 0.30,
           "step_on_over_1f1b": 1.0, "step_on_over_torch_dualpipev": 1.0, "sim_over_measured": [0.90, 1.10],
           "a2a_overlap_on_single_gpu_min": 0.8, "unplanned_host_syncs_single_gpu": 0}
PIPETRAIN_ROWS = {"dualpipev_on": ("dualpipev", "on"), "dualpipev_serial": ("dualpipev", "serial"),
                  "dualpipev_off": ("dualpipev", "off"), "1f1b": ("1f1b", "off")}


class _FixedTime(torch.autograd.Function):
    """Identity (a copy) that sleeps `f_ms` in forward and `b_ms` in backward: no CPU."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, f_ms: float, b_ms: float) -> torch.Tensor:
        ctx.b_ms = b_ms
        _sleep(f_ms, y.device)
        return y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _sleep(ctx.b_ms, grad.device)
        return grad, None, None


def _sleep(ms: float, device: torch.device) -> None:
    """A fixed time on the device: the host sleeps on CPU, the current stream on CUDA."""
    if device.type == "cuda":
        gpu_sleep(ms / 1e3, device)
    else:
        sleep_ms(ms)


class FixedTimeExperts(Experts):
    """The experts of --deterministic: the real SwiGLUs (tiny), then a fixed time per call."""

    f_ms: float = 0.0
    b_ms: float = 0.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # this rank's experts
        return _FixedTime.apply(super().forward(x, counts), self.f_ms, self.b_ms)


def build_model(args: argparse.Namespace) -> Llama:
    model = Llama(seed=args.seed, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=args.blocks_per_stage * 2 * args.pp, num_attention_heads=args.heads,
                  num_key_value_heads=args.heads, max_position_embeddings=args.seq,
                  moe=dict(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.expert_width,
                           balance="aux_free", experts_impl=args.experts_impl))
    if args.deterministic:  # in place: the bench's own stand-in for the experts' compute
        for m in model.modules():
            if type(m) is Experts:
                m.__class__ = FixedTimeExperts
                m.f_ms, m.b_ms = args.expert_f_ms, args.expert_b_ms
    return model


def mirrored_bounds(args: argparse.Namespace, chunks: int) -> list[range]:
    """embedding + k blocks | k blocks | ... | k blocks + head: every V pair mirrors MoE layers."""
    k, n = args.blocks_per_stage * 2 * args.pp // chunks, args.blocks_per_stage * 2 * args.pp + 2
    cuts = [0] + [1 + k * (c + 1) for c in range(chunks - 1)] + [n]
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def batches(args: argparse.Namespace, ep_index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(args.seed + 10 + ep_index)  # each EP rank routes its own tokens
    return [(torch.randint(0, args.vocab, (args.microbatch, args.seq), generator=g),
             torch.randint(0, args.vocab, (args.microbatch, args.seq), generator=g)) for _ in range(args.microbatches)]


class PipetrainRow:
    def __init__(self, schedule: str, fb_overlap: str, groups, eg, args: argparse.Namespace) -> None:
        from pipetrain.parallel.parallelize import Parallelize
        from pipetrain.schedules import registry
        from pipetrain.train.pipeline import Transport, build_rank_pipeline

        self.sched = registry.build(schedule, args.pp, args.microbatches, 2 if schedule == "dualpipev" else 1)
        model = build_model(args)
        self.rp = build_rank_pipeline(
            model, mirrored_bounds(args, self.sched.placement.num_chunks), self.sched, groups.pp_rank,
            microbatch_size=args.microbatch, seq_len=args.seq, parallelize=Parallelize(ep=eg), fb_overlap=fb_overlap,
            device=args.device, precision=args.precision,
            transport=Transport(timeout_s=300, group=groups.pp_group, group_ranks=groups.pipeline_ranks,
                                pipelines=layout(args).pipelines()))
        self.ex, self.mbs, self.stages = self.rp.executor, batches(args, groups.ep_index), self.rp.stages
        self.records: list[dict] = []
        # the serial row's per-node times: the simulator's input
        self.nodes = timed_nodes(self.ex.passes) if fb_overlap == "serial" else None
        self.steps = self.sched.steps[groups.pp_rank]
        self.syncs = SyncCount(self.ex.passes) if args.device == "cuda" and fb_overlap == "on" else None

    def zero_grad(self) -> None:
        for mod in self.stages.values():
            mod.zero_grad(set_to_none=True)

    def step(self) -> None:
        if self.nodes is not None:
            self.nodes.clear()
        res = self.rp.train_step(self.mbs)
        rec: dict[str, Any] = {"loss": res.loss, "peak_activation_bytes": res.peak_activation_bytes,
                               "fb_ms": sum(t.compute_ms for t in res.timings if "&" in t.step)}
        if self.syncs is not None:
            rec["host_syncs_in_pairs"] = self.syncs.take()
        # every token all-to-all of the step (runtime/collectives.py; the counts exchange left out)
        ep = [(t.step, e) for t in res.timings for e in t.collectives if e.group == "ep" and e.label != "a2a:counts"]
        rec["a2a_counts_ms"] = sum(e.total_ms for t in res.timings for e in t.collectives if e.label == "a2a:counts")
        for key, evs in (("a2a", ep), ("a2a_fb", [(st, e) for st, e in ep if "&" in st])):
            rec[f"{key}_ms"] = sum(e.total_ms for _, e in evs)
            rec[f"{key}_exposed_ms"] = sum(e.exposed_ms for _, e in evs)
        if self.nodes is not None:
            rec["costs"] = stage_costs(res.timings, self.ex.passes.log, self.nodes, self.ex.passes.plans, self.steps)
        self.records.append(rec)


class SyncCount:
    """The host syncs inside the interleaved F&B pairs of a CUDA run (torch.cuda.set_sync_debug_mode("warn") around
    each NodeExecution.pair; the planned one per dispatch, runtime/ep_comm.py planned_sync, is exempt there)."""

    def __init__(self, nodes: Any) -> None:
        self.count, pair = 0, nodes.pair

        def counted(*a: Any) -> None:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    pair(*a)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            self.count += sum("synchroniz" in str(w.message) for w in seen)

        nodes.pair = counted  # the instance's, before the class's method

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def layout(args: argparse.Namespace) -> Any:
    from pipetrain.parallel.layout import Layout

    return Layout(pp=args.pp) if args.single else Layout(pp=args.pp, dp_shard=EP, ep=EP)


class TorchRow:
    """torch's ScheduleDualPipeV over the same stage modules (cut, expert parallel, data) as pipetrain's
    dualpipev rows; its PipelineStages on this pipeline's group."""

    def __init__(self, groups, eg, args: argparse.Namespace) -> None:
        from torch.distributed import pipelining as pp

        from pipetrain.models.split import build_stage
        from pipetrain.parallel.ep import parallelize_experts

        model = build_model(args)
        S = 2 * args.pp
        mine = (groups.pp_rank, S - 1 - groups.pp_rank)  # the V placement: rank r holds stages r and S-1-r
        bounds = mirrored_bounds(args, S)
        self.stages = {s: parallelize_experts(build_stage(model, bounds[s], stage_id=s), eg) for s in mine}
        specs = model.boundary_specs(microbatch=args.microbatch, seq=args.seq)
        pstages = []
        for s in sorted(mine):
            inp, out = specs[bounds[s].start].empty(), specs[bounds[s].stop].empty()
            inp.requires_grad_(inp.is_floating_point())
            out.requires_grad_(out.is_floating_point())
            pstages.append(pp.PipelineStage(self.stages[s], s, S, torch.device("cpu"), input_args=(inp,),
                                            output_args=(out,), group=groups.pp_group))
        self.schedule = pp.ScheduleDualPipeV(pstages, args.microbatches, loss_fn=type(model).loss_fn, scale_grads=True)
        mbs = batches(args, groups.ep_index)
        self.idx, self.tgt = torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])
        self.has_first, self.has_last = 0 in self.stages, S - 1 in self.stages
        self.records: list[dict] = []

    def zero_grad(self) -> None:
        for mod in self.stages.values():
            mod.zero_grad(set_to_none=True)

    def step(self) -> None:
        losses: Optional[list] = [] if self.has_last else None
        self.schedule.step(*((self.idx,) if self.has_first else ()), target=self.tgt if self.has_last else None,
                           losses=losses, return_outputs=False)
        self.records.append({"loss": statistics.mean(float(x.detach()) for x in losses) if losses else None})


def rank_main(rank: int, world: int, out: Path, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from pipetrain.parallel.ep import expert_parallel
    from pipetrain.parallel.mesh import build_groups

    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    groups = build_groups(layout(args), args.device)  # no dp step: EP without FSDP2
    if args.single:  # a one-rank EP group: each all-to-all the collective's copy of its bytes
        eg = EPGroup(dist.group.WORLD, 1, 0, delay_s=args.delay_ms / 1e3)
    else:
        eg = replace(expert_parallel(groups), delay_s=args.delay_ms / 1e3)
    rows: dict[str, Any] = {}
    for name in args.row_list:
        rows[name] = TorchRow(groups, eg, args) if name == "torch_dualpipev" else \
            PipetrainRow(*PIPETRAIN_ROWS[name], groups, eg, args)
    walls: dict[str, list[list[float]]] = {name: [] for name in rows}
    for r in range(args.rounds):
        res = run_pairs(rows, args.steps, first=r)
        for name, row in rows.items():
            walls[name].append(res[name][0])
            del row.records[-args.steps - 1]  # the warm-up step
    for row in rows.values():
        if isinstance(row, PipetrainRow):
            row.rp.close()
    recs = gather_object({name: row.records for name, row in rows.items()}, world)
    if rank == 0:
        (out / "raw.json").write_text(json.dumps({"walls_s": walls, "ranks": recs}))


def summarize(raw: dict, args: argparse.Namespace) -> dict:
    def med(name: str, key: str, per_rank=statistics.mean) -> Optional[float]:
        """The median over steps of `key` (mean over the ranks, or per_rank's fold)."""
        vals = [[rec[key] for rec in ranks[name]] for ranks in raw["ranks"]]
        if any(v is None for rank in vals for v in rank):
            return None
        return statistics.median(per_rank(step) for step in zip(*vals))

    out: dict[str, Any] = {}
    for name in args.row_list:
        steps = [1e3 * s for rnd in raw["walls_s"][name] for s in rnd]
        rounds = [statistics.median(1e3 * s for s in rnd) for rnd in raw["walls_s"][name]]
        row: dict[str, Any] = {"step_ms": statistics.median(steps), "step_ms_rounds": rounds,
                               "loss_rank0": raw["ranks"][0][name][0]["loss"]}
        if name in PIPETRAIN_ROWS:
            row["peak_activation_bytes"] = med(name, "peak_activation_bytes", max)
            pairs = name != "1f1b"  # 1F1B has no F&B pairs
            for key in ("a2a_ms", "a2a_exposed_ms", "a2a_counts_ms") + (
                    ("fb_ms", "a2a_fb_ms", "a2a_fb_exposed_ms") if pairs else ()):
                row[key] = med(name, key)
            if "host_syncs_in_pairs" in raw["ranks"][0][name][0]:
                row["host_syncs_in_pairs"] = max(r["host_syncs_in_pairs"] for rk in raw["ranks"] for r in rk[name])
        out[name] = row
    return out


def checks(rows: dict, sim: Optional[dict]) -> dict:
    """Issue #29's bars, as measured (None where a row was not run)."""
    on, serial = rows.get("dualpipev_on"), rows.get("dualpipev_serial")
    ratio = lambda a, b: None if a is None or b is None or not b else a / b  # noqa: E731
    c: dict[str, Any] = {}
    if on and serial:
        c["fb_ms_on_over_serial"] = ratio(on["fb_ms"], serial["fb_ms"])
        c["a2a_exposed_on_over_serial"] = ratio(on["a2a_exposed_ms"], serial["a2a_exposed_ms"])
        c["a2a_fb_exposed_on_over_serial"] = ratio(on["a2a_fb_exposed_ms"], serial["a2a_fb_exposed_ms"])
        c["peak_activation_on_over_serial"] = ratio(on["peak_activation_bytes"], serial["peak_activation_bytes"])
        c["a2a_share_of_serial_fb"] = ratio(serial["a2a_fb_ms"], serial["fb_ms"])
    if on and on.get("a2a_fb_ms"):  # the share of the pairs' all-to-all time hidden under compute
        c["a2a_overlap_on"] = 1.0 - on["a2a_fb_exposed_ms"] / on["a2a_fb_ms"]
    if on and "host_syncs_in_pairs" in on:
        c["unplanned_host_syncs"] = on["host_syncs_in_pairs"]
    if on and "dualpipev_off" in rows:  # whole stages: the executor's accounting without nodes
        off = rows["dualpipev_off"]["peak_activation_bytes"]
        c["peak_activation_on_over_off"] = ratio(on["peak_activation_bytes"], off)
    for other in ("1f1b", "torch_dualpipev", "dualpipev_off"):
        if on and other in rows:
            c[f"step_on_over_{other}"] = ratio(on["step_ms"], rows[other]["step_ms"])
    if sim and on:
        c["sim_fb_over_measured"] = ratio(sim["fb_ms_on"], on["fb_ms"])
        c["sim_step_over_measured"] = ratio(sim["step_ms_on"], on["step_ms"])
        if serial:
            c["sim_serial_step_over_measured"] = ratio(sim["step_ms_serial"], serial["step_ms"])
    return c


def run_layout(args: argparse.Namespace, layout: str) -> dict:
    args = argparse.Namespace(**{**vars(args), "pp": LAYOUTS[layout]})
    work = Path(tempfile.mkdtemp(prefix="pipetrain-bench-"))
    ep = 1 if args.single else EP
    spawn_local(rank_main, args.pp * ep, work, args, backend="nccl" if args.device == "cuda" else "gloo")
    raw = json.loads((work / "raw.json").read_text())
    rows = summarize(raw, args)
    # the simulator check reads host-timed nodes: CPU runs only
    sim = simulated(raw, args) if "dualpipev_serial" in rows and args.device == "cpu" else None
    return {"pp": args.pp, "ep": ep, "world": args.pp * ep, "device": args.device, "rows": rows, "simulated": sim,
            "checks": checks(rows, sim)}


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="pp1,pp2", help=f"comma separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma separated, of {', '.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of every row per round, after 1 warm-up each")
    for knob, help_ in (("microbatches", "M per pipeline"), ("microbatch", "sequences per microbatch"), ("seq", ""),
                        ("hidden", ""), ("heads", ""), ("vocab", ""), ("experts", ""), ("top-k", ""),
                        ("expert-width", "model.moe.intermediate_size"),
                        ("blocks-per-stage", "MoE blocks per V stage")):
        ap.add_argument(f"--{knob}", type=int, default=None, help=help_ or None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true",
                    help="fixed-time experts and an emulated all-to-all delay (no CPU) on a tiny model: the CI variant")
    ap.add_argument("--single", action="store_true",
                    help="one process, a one-rank EP group, on the GPU when one is visible: issue #29's one-GPU check")
    ap.add_argument("--net-gbs", type=float, default=50.0, help="--single: the emulated network's GB/s")
    ap.add_argument("--delay-ms", type=float, default=None, help="emulated delay per token all-to-all")
    ap.add_argument("--expert-f-ms", type=float, default=None, help="--deterministic: experts' forward time per call")
    ap.add_argument("--expert-b-ms", type=float, default=None, help="--deterministic: experts' backward time per call")
    ap.add_argument("--out", default=None, help="default bench/results/moe_fb_overlap[_deterministic].json")
    args = ap.parse_args(argv)
    if args.single and args.deterministic:
        ap.error("--single and --deterministic are two variants: pick one")
    args.device = "cuda" if args.single and torch.cuda.is_available() else "cpu"
    defaults = DETERMINISTIC if args.deterministic else REAL_GLOO
    if args.single:
        defaults = SINGLE_GPU if args.device == "cuda" else SINGLE_DRYRUN
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.precision, args.experts_impl = ("bf16", "grouped") if args.device == "cuda" else ("fp32", "loop")
    if args.single:
        if args.delay_ms is None:  # the token rows of one all-to-all at --net-gbs
            nbytes = args.microbatch * args.seq * args.top_k * args.hidden * (2 if args.precision == "bf16" else 4)
            args.delay_ms = 1e3 * nbytes / (args.net_gbs * 1e9)
        if args.layouts == ap.get_default("layouts"):
            args.layouts = "pp1"
        if args.rows == ap.get_default("rows"):  # torch's row builds its stages on the CPU
            args.rows = ",".join(r for r in ROWS if r != "torch_dualpipev")
    args.row_list = [r for r in args.rows.split(",") if r]
    args.layout_list = [x for x in args.layouts.split(",") if x]
    for bad in [r for r in args.row_list if r not in ROWS] + [x for x in args.layout_list if x not in LAYOUTS]:
        ap.error(f"unknown row or layout {bad!r}")
    return args


def run(args: argparse.Namespace) -> dict:
    load = os.getloadavg()
    layouts = {name: run_layout(args, name) for name in args.layout_list}
    config = {k: v for k, v in vars(args).items() if k not in ("out", "row_list", "layout_list")}
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "cpu": cpu_model(), "loadavg_before": load, "loadavg_after": os.getloadavg(),
            "pipetrain_source": pipetrain_source(), "config": config, "targets": TARGETS, "layouts": layouts}


def main() -> None:
    args = parse()
    doc = run(args)
    variant = "_deterministic" if args.deterministic else "_single" if args.single else ""
    dryrun = "_dryrun" if args.single and args.device == "cpu" else ""
    out = Path(args.out or Path(__file__).parent / "results" / f"moe_fb_overlap{variant}{dryrun}.json")
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for name, lay in doc["layouts"].items():
        for row, r in lay["rows"].items():
            keys = ("fb_ms", "a2a_ms", "a2a_exposed_ms", "a2a_fb_exposed_ms")
            print(f"{name} {row:>17}: step {r['step_ms']:8.1f} ms" + "".join(
                f"  {k} {r[k]:.1f}" for k in keys if r.get(k) is not None))
        print(f"{name} checks: " + ", ".join(f"{k} {v:.3f}" for k, v in lay["checks"].items() if v is not None))
    print(f"load {doc['loadavg_before']} -> {doc['loadavg_after']}; wrote {out}")


if __name__ == "__main__":
    main()
