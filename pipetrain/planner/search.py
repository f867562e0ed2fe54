"""Score one (layout, schedule, v, M, microbatch size, recompute) by simulation, and rank many
(the candidates themselves: planner/space.py).

Time: `plan.simulate_layout`, the path a run's make_plan takes, with the candidate as its inputs: the
makespan of the lowered schedule under the partition's per-stage F, B, W (recompute adds F to B, and to
W where a stage runs W apart), each transfer costing latency + boundary bytes / bandwidth (`comm_ms`),
the data-parallel reduce lane (schedules/reduce_cost.py) and what it leaves exposed; here plus the
optimizer step (state bytes over memory bandwidth) and the calibrated overheads a run adds (per
action, per layer, per reduction, per step: planner/calibrate.py).
Under tensor parallel each layer is one tp rank's (schedules/tp_cost.py `tp_rank_layers`:
compute / tp and TP collectives, dense parameters / tp, activations per Korthikanti et al. 2022); under context
parallel 1/cp of every sequence plus the K/V exchanges, and under expert parallel the MoE layers' all-to-alls
of the tokens a rank dispatches (its 1/cp, and 1/tp of those where etp = 1) and 1/(ep x etp) of their experts
(partition/costs.py `cp_layer_costs`, `ep_layer_costs`: plan.layer_costs' path).
Memory: planner/memory.py, with the activation peak taken from the same simulated timeline.
`zb_auto` gets the largest activation budget the memory cap leaves (at most 2P, ZB-2p's).

Pure Python, no torch: the caller (planner/cmd.py) turns a Config into a `Workload` (planner/workload.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from pipetrain.partition.costs import LayerCost, cp_layer_costs, ep_layer_costs
from pipetrain.partition.partition import Partition
from pipetrain.partition.strategies import partition
from pipetrain.planner.memory import (GB, RankMemory, gb_text, loss_rank_bytes, peak_activation_bytes,
                                      rank_memory, sync_copy_bytes)
from pipetrain.planner.rows import Row
from pipetrain.planner.space import Candidate
from pipetrain.planner.topology import layout_links
from pipetrain.planner.workload import Device, Workload
from pipetrain.execution import overlaps
from pipetrain.plan import GradReduce, LayoutInputs, SimulatedPlan, simulate_layout
from pipetrain.schedules import registry
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.reduce_cost import DTYPE_BYTES
from pipetrain.schedules.simulate import simulate
from pipetrain.schedules.tp_cost import tp_rank_layers
from pipetrain.schedules.validate import hangs_on_nccl


@dataclass(frozen=True)
class _MemoryModel:
    """One candidate's memory, all but the activations' peak (which its simulated timeline gives)."""

    stage_bytes: dict[int, float]  # per stage id: what one microbatch's F keeps (recomputing: its layers' inputs)
    static: list[RankMemory]  # per rank: weights, gradients and optimizer states, the receive buffers
    transient: list[float]  # per rank, while a backward runs: one recomputing layer's activations + the loss's backward
    loss_grad: list[float]  # per rank: the loss's backward (the rank of the last stage)
    stage_params: list[float]  # per stage id (DualPipe's mirrors hold copies)
    overhead: float  # per device, outside the allocator
    room: list[float]  # per rank: bytes the cap leaves for activations (negative: over already)


class _Evaluator:
    def __init__(self, work: Workload, device: Device) -> None:
        self.work, self.device = work, device
        self._whole: dict[int, tuple[LayerCost, ...]] = {}
        self._layers: dict[tuple[int, int, bool, int, int], tuple[LayerCost, ...]] = {}
        self._ratio: dict[int, tuple[float, ...]] = {}
        self._cuts: dict[tuple, Partition] = {}
        self._links: dict[tuple, tuple[Device, str]] = {}

    def first_stage_ratio(self, mbs: int) -> Sequence[float]:
        if self.work.first_stage_activation_ratio is None:
            return [1.0] * len(self.layers(mbs))
        if mbs not in self._ratio:
            self._ratio[mbs] = tuple(self.work.first_stage_activation_ratio(mbs))
        return self._ratio[mbs]

    def layers(self, mbs: int, tp: int = 1, sp: bool = False, ep: int = 1, cp: int = 1,
               etp: Optional[int] = None) -> tuple[LayerCost, ...]:
        """One tp / cp / ep rank's per-layer costs of one microbatch (plan.layer_costs' order: cp, ep, then
        tp; `etp` None: tp), calibrated overhead included."""
        if mbs not in self._whole:
            self._whole[mbs] = tuple(self.work.layers(mbs))
        etp = tp if etp is None else etp
        key = (mbs, tp, sp, ep, cp, etp)
        if key not in self._layers:
            w, o = self.work, self.device.layer_overhead_ms
            dev = self.group_device(dp=ep, cp=cp, tp=tp, ep=ep, etp=etp)
            tokens, value = mbs * w.seq, w.value_bytes
            timed = self._whole[mbs] if w.sharded_layers is None else w.sharded_layers(mbs, tp, cp, sp)
            whole = cp_layer_costs(timed, cp=cp, tokens=tokens, bytes_per_value=value,
                                   bandwidth_gbs=dev.cp_gbs, rotate=dev.cp_rotate)
            # the tokens a rank dispatches: its own 1/cp, and 1/tp of those where the experts are whole (etp = 1)
            whole = ep_layer_costs(whole, ep=ep, tokens=tokens // (cp * (tp // etp)), bytes_per_value=value,
                                   bandwidth_gbs=dev.ep_gbs)
            split = tp_rank_layers(whole, tp=tp, sequence_parallel=sp, tokens=tokens, hidden=w.hidden,
                                   vocab=w.vocab, value_bytes=w.value_bytes, bandwidth_gbs=dev.tp_gbs,
                                   replicated_bytes_per_token=w.tp_replicated_bytes_per_token,
                                   latency_ms=dev.tp_latency_ms, etp=etp)
            self._layers[key] = tuple(
                dataclasses.replace(l, f_ms=l.f_ms + o, b_ms=l.b_ms + o, w_ms=l.w_ms + o) if o else l for l in split)
        return self._layers[key]

    def group_device(self, *, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1,
                     etp: Optional[int] = None) -> Device:
        """The device with each group's link where its ranks fall on nodes (plan.device: planner/topology.py);
        the configured links as they are otherwise."""
        dev = self.device
        if dev.spec is None:
            return dev
        key = (pp, dp, cp, tp, ep, etp)
        if key not in self._links:
            links = layout_links(dev.spec, dev.per_node, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, etp=etp)
            self._links[key] = (dataclasses.replace(
                dev, tp_gbs=links.tp.gbs, tp_latency_ms=dev.tp_latency_ms + links.tp.latency_ms, cp_gbs=links.cp.gbs,
                ep_gbs=links.ep.gbs, dp_gbs=links.dp.gbs, reduce_latency_ms=dev.reduce_latency_ms + links.dp.latency_ms,
                p2p_gbs=links.pp.gbs, p2p_latency_ms=dev.p2p_latency_ms + links.pp.latency_ms), links.crossing())
        return self._links[key][0]

    def crossing(self, c: Candidate) -> str:
        """The candidate's groups that leave a node ('' without plan.device)."""
        if self.device.spec is None:
            return ""
        self.group_device(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp, ep=c.ep, etp=c.expert_tp)
        return self._links[(c.pp, c.dp, c.cp, c.tp, c.ep, c.expert_tp)][1]

    def cut(self, c: Candidate) -> Partition:
        """The candidate's partition of its layers into its placement's chunks (one per layer costs,
        chunk count and strategy: the merge of alike strategies and the evaluation share it)."""
        chunks = registry.placement_for(c.schedule, c.pp, c.v).num_chunks
        key = (c.microbatch_size, c.tp, c.sequence_parallel, c.ep, c.cp, c.expert_tp, chunks, c.partition)
        if key not in self._cuts:
            self._cuts[key] = partition(self.rank_layers(c), chunks, c.partition)
        return self._cuts[key]

    def rank_layers(self, c: Candidate) -> tuple[LayerCost, ...]:
        return self.layers(c.microbatch_size, c.tp, c.sequence_parallel, c.ep, c.cp, c.expert_tp)

    @staticmethod
    def seq_split(cand: Candidate) -> int:
        """How many ranks split one microbatch's tokens: cp, times tp under sequence parallel."""
        return (cand.tp if cand.sequence_parallel else 1) * cand.cp

    def boundary_bytes(self, cand: Candidate) -> float:  # one microbatch across a stage boundary (1/tp under sp, 1/cp)
        tokens = cand.microbatch_size * self.work.seq
        return self.work.boundary_bytes_per_token * tokens / self.seq_split(cand)

    def memory_model(self, cand: Candidate, placement: Placement, part: Partition,
                     recompute: frozenset[int]) -> _MemoryModel:
        """What the candidate keeps per microbatch and per rank before its schedule is known. Recompute keeps each
        layer's input, and while a backward recomputes a layer, its activations (`transient`, on the peak)."""
        work, dev = self.work, self.device
        layers = self.rank_layers(cand)
        tokens = cand.microbatch_size * work.seq
        seq_split = self.seq_split(cand)
        boundary = self.boundary_bytes(cand)
        model_input = boundary if work.input_bytes_per_token is None else work.input_bytes_per_token * tokens / cand.cp
        first_stage_input = boundary if work.first_stage_bytes_per_token is None else \
            work.first_stage_bytes_per_token * tokens / seq_split
        # the vocab-parallel loss: 1/tp per rank, of the rank's 1/cp of the tokens
        on_tp = functools.partial(loss_rank_bytes, tokens=tokens // cand.cp, tp=cand.tp)
        loss = [on_tp(work.loss_bytes_per_token) if rng.stop == len(layers) else 0.0 for rng in part.bounds]
        inputs_kept = [(model_input + first_stage_input * (len(rng) - 1) if rng.start == 0 else boundary * len(rng))
                       + chunk_loss for rng, chunk_loss in zip(part.bounds, loss)]
        ratio = self.first_stage_ratio(cand.microbatch_size)
        bf16_params = cand.dp_shard and cand.dp > 1 and not work.fsdp_casts  # FSDP2 computes in bf16 params: no copies
        copies = work.weight_copy_bytes if work.weight_copy_bytes and not bf16_params else [0.0] * len(layers)
        saved = [[layers[i].activation_bytes_per_token * (ratio[i] if rng.start == 0 else 1.0) * tokens
                  + copies[i] / cand.tp for i in rng] for rng in part.bounds]
        all_saved = [math.fsum(x) + chunk_loss for x, chunk_loss in zip(saved, loss)]
        if cand.selective:  # the layers' selective bytes (LayerCost.selective), nothing recomputed whole
            inputs_kept = [math.fsum(layers[i].selective(work.recompute_modules)[0] * (ratio[i] if rng.start == 0
                                     else 1.0) * tokens + copies[i] / cand.tp for i in rng) + chunk_loss
                           for rng, chunk_loss in zip(part.bounds, loss)]
        stage_bytes = {s: (inputs_kept if s in recompute else all_saved)[placement.chunk_of(s)]
                       for s in range(placement.num_stages)}
        stage_params = [float(part.chunk_params()[placement.chunk_of(s)]) for s in range(placement.num_stages)]
        experts = [math.fsum(part.layers[i].experts_params for i in rng) for rng in part.bounds]
        stage_experts = [experts[placement.chunk_of(s)] for s in range(placement.num_stages)]
        static = [rank_memory(r, params=math.fsum(stage_params[s] for s in placement.stages_of(r)), state=work.state,
                              shard=self.param_shard(cand), activations=0.0, boundary_bytes=boundary,
                              stages=placement.stages_per_rank, lookahead=dev.lookahead, margin=0.0,
                              expert_params=math.fsum(stage_experts[s] for s in placement.stages_of(r)),
                              expert_shard=self.expert_shard(cand)) for r in range(cand.pp)]
        largest_layer = [max(x) for x in saved]
        last_ranks = {placement.rank_of(s) for s in range(placement.num_stages)
                      if part.bounds[placement.chunk_of(s)].stop == len(layers)}
        loss_grad = [on_tp(work.loss_grad_bytes_per_token) if r in last_ranks else 0.0 for r in range(cand.pp)]
        whole = recompute if not cand.selective else frozenset()  # selective: a module's few values at a time
        transient = [max((largest_layer[placement.chunk_of(s)] for s in placement.stages_of(r) if s in whole),
                         default=0.0) + loss_grad[r] for r in range(cand.pp)]  # both while a backward runs: on the peak
        overhead = dev.gpu_overhead_gb * GB
        room = [(dev.memory_gb * GB - overhead) / (1 + dev.margin) - m.total - t for m, t in zip(static, transient)]
        return _MemoryModel(stage_bytes, static, transient, loss_grad, stage_params, overhead, room)

    def zb_auto_budgets(self, row: Row, mem: _MemoryModel) -> Optional[list[float]]:
        """Per rank, zb_auto's activation budget: the microbatches its memory leaves, at most 2P (ZB-2p's);
        None (the reason on the row) when one does not fit."""
        pp = row.candidate.pp
        budgets = [math.floor(min(2.0 * pp, mem.room[r] / mem.stage_bytes[r]) * 100) / 100 for r in range(pp)]
        low = min(range(pp), key=lambda r: budgets[r])
        if budgets[low] < 1.0:
            row.reason = f"OOM on rank {low}: one microbatch of activations does not fit"
            return None
        row.memory_budget, row.budgets = budgets[low], budgets
        return budgets

    def grad_copies(self, c: Candidate, pl: Placement, part: Partition,
                    stage_params: list[float]) -> tuple[dict[int, float], list[float]]:
        """Per stage, the data-parallel reducer's flat copies (replicas only: FSDP2 reduce-scatters in
        its own buffers), and per rank, what GradSync.sync allocates for the weights held on several
        ranks: each chunk held by more than one rank (DualPipe's mirror) and each tied weight whose
        copies land on different ranks, their fp32 gradients (a shard's under FSDP2). Without dp, tp or cp
        those sums start during the step (GradSync.early): their buffers count as held from each holding
        stage's last weight gradient, beside the activations still alive then."""
        replicas = c.dp > 1 and not c.dp_shard and c.cp == 1  # cp ranks shard the parameters (plan.grad_reduce)
        held = {s: p * DTYPE_BYTES[self.device.reduce_dtype] for s, p in enumerate(stage_params)} if replicas else {}
        grad = self.work.state.grad / self.param_shard(c)
        chunk_stages = [[s for s in range(pl.num_stages) if pl.chunk_of(s) == k] for k in range(pl.num_chunks)]
        holding: dict[str, tuple[list[int], float]] = {  # weight -> the stages holding a copy, its bytes
            f"chunk{k}": (stages, p * grad) for k, (stages, p) in enumerate(zip(chunk_stages, part.chunk_params()))}
        layer_chunk = {i: k for k, rng in enumerate(part.bounds) for i in rng}
        for n, (layers, numel) in enumerate(self.work.tied):  # a stage holding two of the layers holds one copy
            holding[f"tied{n}"] = (sorted({s for i in layers for s in chunk_stages[layer_chunk[i]]}),
                                   numel / c.tp * grad)
        weights = {name: ([pl.rank_of(s) for s in stages], nbytes) for name, (stages, nbytes) in holding.items()}
        if c.dp * c.tp * c.cp == 1:  # GradSync.early: each rank's copies go into their sum's buffer from its last W on
            for stages, nbytes in holding.values():
                ranks = [pl.rank_of(s) for s in stages]
                if len(set(ranks)) > 1:
                    for s in stages:
                        held[s] = held.get(s, 0.0) + nbytes / ranks.count(pl.rank_of(s))
        return held, [sync_copy_bytes(weights, r) for r in range(c.pp)]

    def evaluate(self, cand: Candidate) -> Row:
        """The candidate's memory, then (if its weights fit) plan.simulate_layout of its layout, with the
        activations' peak read off the simulated timeline."""
        row, dev = Row(cand), self.device
        placement = registry.placement_for(cand.schedule, cand.pp, cand.v)
        part = self.cut(cand)
        row.cut = tuple((r.start, r.stop) for r in part.bounds)
        row.links = self.crossing(cand)
        recompute = cand.recompute_stages(placement)
        mem = self.memory_model(cand, placement, part, recompute)
        worst = min(range(cand.pp), key=lambda r: mem.room[r])
        if mem.room[worst] < 0:
            row.reason = (f"OOM on rank {worst} by {gb_text(-mem.room[worst] * (1 + dev.margin))} GB "
                          f"(weights and optimizer state alone)")
            row.memory = [RankMemory(static.rank, static.states, 0.0, static.receive,
                                     dev.margin * (static.total + transient), recompute=transient - loss_grad,
                                     loss_grad=loss_grad, overhead=mem.overhead)
                          for static, transient, loss_grad in zip(mem.static, mem.transient, mem.loss_grad)]
            return row
        budgets = None
        if cand.schedule == "zb_auto":
            budgets = self.zb_auto_budgets(row, mem)
            if budgets is None:
                return row
        laid = simulate_layout(self.layout_inputs(cand, part, recompute, budgets))
        # a named schedule's P2P order on NCCL (zb_auto's searched orders are left to the run's validate)
        if cand.schedule != "zb_auto" and cand.pp > 1 and dev.p2p_transport != "pair_groups" and hangs_on_nccl(
                laid.schedule, lookahead=dev.lookahead, transport=dev.p2p_transport):
            row.reason = f"hangs on NCCL under pipeline.p2p_transport={dev.p2p_transport} (pair_groups runs it)"
            return row
        row.memory = self.rank_memories(cand, placement, part, mem, laid)
        sim = laid.result
        optimizer_ms = max(m.states for m in mem.static) / (dev.optim_gbs * GB) * 1e3 if dev.optim_gbs > 0 else 0.0
        row.pred_step_ms = sim.makespan_with_reduce + optimizer_ms + dev.step_overhead_ms
        row.bubble = sim.bubble_fraction_mean
        no_comm = simulate(laid.schedule, laid.stage_costs, comm_ms=0.0, check=False).makespan \
            if laid.comm_ms > 0 else sim.makespan
        row.exposed_comm_ms = sim.makespan_with_reduce - no_comm
        tokens = cand.dp * cand.microbatches * cand.microbatch_size * self.work.seq
        row.tokens_per_s = tokens / (row.pred_step_ms / 1e3) if row.pred_step_ms > 0 else math.inf
        self.throughput(row, recompute, placement.num_stages)
        over = row.peak.total - dev.memory_gb * GB
        row.feasible = over <= 0
        row.reason = "" if row.feasible else f"OOM on rank {row.peak.rank} by {gb_text(over)} GB"
        return row

    def throughput(self, row: Row, recompute: frozenset[int], stages: int) -> None:
        """The row's FLOP rates per device: model FLOPs (MFU's count), executed FLOPs (recompute's share of the
        stages added, Megatron-LM's count) and MFU against the device's peak."""
        c, work = row.candidate, self.work
        if not work.model_flops_per_token or not row.tokens_per_s or math.isinf(row.tokens_per_s):
            return
        world = c.pp * c.dp * c.cp * c.tp
        executed = work.model_flops_per_token + work.recompute_flops_per_token * len(recompute) / stages
        row.tflops_per_device = row.tokens_per_s * work.model_flops_per_token / world / 1e12
        row.hw_tflops_per_device = row.tokens_per_s * executed / world / 1e12
        row.mfu = row.tflops_per_device / self.device.peak_tflops if self.device.peak_tflops else None

    def layout_inputs(self, cand: Candidate, part: Partition, recompute: frozenset[int],
                      budgets: Optional[list[float]]) -> LayoutInputs:
        """The candidate as plan.simulate_layout's inputs: what a run's config of this row gives make_plan."""
        work, c = self.work, cand
        dev = self.group_device(pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp, ep=c.ep, etp=c.expert_tp)
        comm_ms = dev.p2p_latency_ms + self.boundary_bytes(cand) / (dev.p2p_gbs * GB) * 1e3 if cand.pp > 1 else 0.0
        grad_reduce = None if cand.dp * cand.cp == 1 else GradReduce(  # as plan.grad_reduce: cp shards with dp_shard
            1 if cand.dp_shard else cand.dp, self.param_shard(cand), dev.dp_gbs, dev.reduce_dtype,
            latency_ms=dev.reduce_latency_ms, overlap=dev.grad_overlap)
        return LayoutInputs(cand.schedule, cand.pp, cand.microbatches, cand.v, part, recompute_stages=recompute,
                            recompute_modules=work.recompute_modules if cand.selective else (),
                            comm_ms=comm_ms, action_overhead_ms=dev.action_overhead_ms, w_keep=work.w_keep,
                            memory_budget=budgets, grad_reduce=grad_reduce,
                            overlap_layers=overlaps(dev.fb_overlap, recompute=cand.recompute and not cand.selective))

    @classmethod
    def expert_shard(cls, cand: Candidate) -> int:
        """The ranks FSDP2 shards an expert's weights over (its edp group): dp x cp x tp / (ep x etp) of them."""
        return cls.param_shard(cand) * (cand.tp // cand.expert_tp) // cand.ep

    @staticmethod
    def param_shard(cand: Candidate) -> int:
        """The ranks FSDP2 shards a dense parameter over: dp (where sharded) times cp; an expert's over 1/ep of them."""
        return (cand.dp if cand.dp_shard else 1) * cand.cp

    def rank_memories(self, cand: Candidate, placement: Placement, part: Partition, mem: _MemoryModel,
                      laid: SimulatedPlan) -> list[RankMemory]:
        """Each rank's peak: states, the activations' peak on its simulated timeline, the gradient copies at
        their worst moment over it, the transient peaks and the margin."""
        keep = dict(enumerate(laid.w_keep))
        held, sync = self.grad_copies(cand, placement, part, mem.stage_params)
        out = []
        for r, m in enumerate(mem.static):
            timeline = laid.result.timeline[r]
            activations = peak_activation_bytes(timeline, mem.stage_bytes, keep)
            # the reducer's copies join the activations during the drain; the sync's come after them
            with_held = peak_activation_bytes(timeline, mem.stage_bytes, keep, held) if held else activations
            copies = max(with_held, sync[r]) - activations
            base = m.states + activations + mem.transient[r] + copies + m.receive
            out.append(RankMemory(r, m.states, activations, m.receive, self.device.margin * base,
                                  recompute=mem.transient[r] - mem.loss_grad[r], loss_grad=mem.loss_grad[r],
                                  grad_copies=copies, overhead=mem.overhead))
        return out


def lower_bound_ms(ev: _Evaluator, c: Candidate) -> float:
    """No schedule beats every rank busy from start to end with its share of the work."""
    every = c.recompute and c.recompute_ranks is None  # recomputing on some ranks only: bound without it
    total = math.fsum(l.total_ms + (l.f_ms if every else 0.0)
                      for l in ev.rank_layers(c))
    return c.microbatches * total / c.pp


def rank_rows(rows: Iterable[Row], objective: str = "tokens_per_s") -> list[Row]:
    """Feasible rows first, best objective first; then the rest, nearest to fitting first."""
    def key(r: Row):
        if r.feasible:
            score = r.tokens_per_s / (r.pred_peak_gb or 1.0) if objective == "tokens_per_s_per_gb" else r.tokens_per_s
            return (0, -score)
        return (1, r.pred_peak_gb if r.pred_peak_gb is not None else math.inf)
    return sorted(rows, key=key)


def search(work: Workload, device: Device, cands: Sequence[Candidate], *, objective: str = "tokens_per_s",
           time_limit_s: float = 60.0, prune: bool = True) -> list[Row]:
    """Evaluate candidates, cheapest lower bound first; with `prune`, skip the simulation of a
    candidate whose lower bound cannot beat the best feasible step time found so far."""
    ev = _Evaluator(work, device)
    cands = one_candidate_per_cut(ev, cands)
    bound = {c: lower_bound_ms(ev, c) for c in cands}  # costs every microbatch size first (a profile, if calibrating)
    start, best = time.perf_counter(), math.inf
    rows = []
    for c in sorted(cands, key=lambda c: bound[c] / (c.dp * c.microbatches * c.microbatch_size)):
        lb = bound[c]
        if time.perf_counter() - start > time_limit_s:
            rows.append(Row(c, reason=f"not evaluated: plan.time_limit_s={time_limit_s:g} reached"))
            continue
        if prune and objective == "tokens_per_s" and lb / (c.dp * c.microbatches * c.microbatch_size) >= best:
            rows.append(Row(c, reason=f"pruned: at least {lb:.1f} ms, slower per sample than the best row"))
            continue
        row = ev.evaluate(c)
        if row.feasible:
            best = min(best, row.pred_step_ms / (c.dp * c.microbatches * c.microbatch_size))
        rows.append(row)
    return rank_rows(rows, objective)


def one_candidate_per_cut(ev: "_Evaluator", cands: Sequence[Candidate]) -> list[Candidate]:
    """Candidates that differ only in a partition strategy that cuts the layers alike are one: the
    first listed (a model of equal layers cuts the same by every strategy; at pp=1 every strategy
    cuts one chunk). Decided before pruning, so a merged strategy never shows as a pruned row."""
    if len({c.partition for c in cands}) < 2:
        return list(cands)
    kept: dict[tuple, Candidate] = {}
    for c in cands:
        kept.setdefault((dataclasses.replace(c, partition=""), ev.cut(c).bounds), c)
    return list(kept.values())
