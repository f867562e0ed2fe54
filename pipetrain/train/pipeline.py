"""Assemble one rank's pipeline: its stage modules, P2P buffers, executor and grad sync.

Every rank is handed the same model, usually built on the meta device (shapes only), cuts the
stages its placement gives it, parallelizes them there (parallel/parallelize.py) and then
materializes only its tp slices and dp shards: each parameter initialised from (seed, its name),
so a layer's initial weights do not depend on the partition, the layout or the rank, and no rank
holds more than its own parts (models/init.py). A model built for real is copied instead.
Receive buffers get their shape and dtype from the model's boundary specs: an activation
entering stage s has the spec of its chunk's first layer boundary, the gradient sent back to
it the same. Under `precision="bf16"` a floating-point boundary crosses in bf16 (the executor
casts what it sends), so its buffers are bf16; integer boundaries (token ids) keep their dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models.base import COMPUTE_DTYPES, LayeredModel
from pipetrain.models.hf import pretrained_rule
from pipetrain.models.init import InitRule, materialize
from pipetrain.models.split import StageModule, cut_stage, on_meta
from pipetrain.runtime.comm import P2P
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.step_loss import GlobalTokens
from pipetrain.runtime.step_result import StepResult
from pipetrain.parallel.mesh import RankGroups, build_pair_groups
from pipetrain.parallel.parallelize import Parallelize, TensorParallel
from pipetrain.runtime.sync import GradSync
from pipetrain.config import Config
from pipetrain.config.cluster import one_hw_queue
from pipetrain.config.data import DataConfig
from pipetrain.plan import Plan, build_model
from pipetrain.schedules.ir import Schedule
from pipetrain.schedules.lower import split_on
from pipetrain.schedules.p2p import TRANSPORT_STREAMS, Kind, Message, exchange_pairs
from pipetrain.train.tokenizer import load_tokenizer


def _pair_groups(schedule: Schedule, t: Transport, device: torch.device) -> Optional[dict[int, dist.ProcessGroup]]:
    """pipeline.p2p_transport=pair_groups: this rank's pair groups by peer global rank (collective
    over the world); one_group: None (everything on the pipeline's group)."""
    if t.kind not in TRANSPORT_STREAMS:
        raise ValueError(f"pipeline.p2p_transport must be {' or '.join(TRANSPORT_STREAMS)} (got {t.kind!r})")
    if t.kind == "one_group" or not dist.is_initialized():
        return None
    pipelines = t.pipelines
    if pipelines is None:  # one pipeline: the world, or the ranks of `group`
        pipelines = [t.group_ranks if t.group_ranks is not None else list(range(schedule.num_ranks))]
    # On NCCL the watchdog ends a hung P2P after the group's timeout (the host does not time its
    # waits there); gloo's waits are timed by the transport, so its groups keep the default.
    nccl = dist.get_backend() == "nccl"
    return build_pair_groups(exchange_pairs(schedule), pipelines, rank=dist.get_rank(), device=device,
                             timeout_s=t.timeout_s if nccl else None)


@dataclass
class RankPipeline:
    rank: int
    schedule: Schedule
    stages: dict[int, nn.Module]
    executor: Executor
    sync: GradSync
    parallel: Parallelize = Parallelize()  # what the stages were parallelized with

    @property
    def tp(self) -> Optional[TensorParallel]:
        return self.parallel.tp

    def parameters(self) -> list[nn.Parameter]:
        """This rank's distinct parameters (a Parameter shared inside a stage appears once)."""
        seen: dict[int, nn.Parameter] = {}
        for s in sorted(self.stages):
            for p in self.stages[s].parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[int, str, nn.Parameter]]:
        """(stage, unsplit name, parameter) for every parameter of every local stage."""
        return [(s, n, p) for s in sorted(self.stages) for n, p in self.stages[s].named_parameters()]

    def train_step(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   tokens: Optional[GlobalTokens] = None, docs: Optional[Sequence[Documents]] = None) -> StepResult:
        """Forward and backward of all microbatches, then gradients summed over copies. `tokens`: the global
        batch's loss tokens where microbatches count unequal ones (runtime/step_loss.py); `docs`: their
        documents, cut from whole rows under context parallel."""
        result = self.executor.step(microbatches, tokens, docs)
        if self.tp is not None:  # whole weights each tp rank used on part of the tokens / heads
            self.tp.reduce_partial(self.stages)
        self.sync.sync()
        return result

    def close(self) -> None:
        self.executor.close()

    def norm_parameters(self) -> list[nn.Parameter]:
        """What this rank adds to the global gradient norm: the weights it owns in its pipeline
        (GradSync.owned), and under tensor parallel only its slices of split weights and its experts
        unless it is tp index 0 (whole weights are equal on every tp rank: counted once)."""
        if self.tp is None or self.tp.g.rank == 0:
            return self.sync.owned()
        # experts split over ep are this rank's own too: with etp = 1, ep takes the tp ranks (other experts)
        experts = {m.tied.get(n, n) for m in self.stages.values() for n in m.ep_shards}
        return self.sync.owned(only=self.tp.sharded_names(self.stages) | experts)


@dataclass(frozen=True)
class Transport:
    """How this rank's pipeline exchanges tensors (the pipeline.p2p_* knobs) and with whom: `group`
    is this pipeline's process group, `group_ranks` its global ranks and `pipelines` every pipeline's
    global ranks (None: one pipeline, the world). "pair_groups" gives every pair of pipeline ranks that
    exchange tensors its own process group (every rank of the world creates every pipeline's:
    parallel/mesh.py: build_pair_groups); "one_group" posts all P2P on `group`."""

    timeout_s: float = 300.0
    lookahead: int = 1
    in_order: bool = False
    kind: str = "pair_groups"
    group: Optional[dist.ProcessGroup] = None
    group_ranks: Optional[list[int]] = None
    pipelines: Optional[list[list[int]]] = None

    @classmethod
    def of(cls, config: Config, groups: RankGroups) -> Transport:
        """The transport of `config`'s pipeline.p2p_* knobs over this rank's pipeline group."""
        p, many = config.pipeline, config.layout.world > config.layout.pp  # several pipelines (dp, tp, cp)
        return cls(timeout_s=p.p2p_timeout_s, lookahead=p.p2p_lookahead, in_order=p.p2p_in_order,
                   kind=p.p2p_transport, group=groups.pp_group, group_ranks=groups.pipeline_ranks if many else None,
                   pipelines=config.layout.pipelines() if many else None)


def build_rank_pipeline(model: LayeredModel, bounds: Sequence[range], schedule: Schedule, rank: int, *,
                        microbatch_size: int, seq_len: int = 1, device: torch.device | str = "cpu",
                        precision: str = "fp32", seed: Optional[int] = None, init_rule: Optional[InitRule] = None,
                        parallelize: Parallelize = Parallelize(), transport: Transport = Transport(),
                        fb_overlap: str = "off") -> RankPipeline:
    """Collective when the schedule has several ranks: every rank must call it.

    `rank` is the pipeline rank. Each local stage is cut from `model` (on the meta device: shapes
    only), parallelized by `parallelize`'s ordered steps (parallel/parallelize.py: tensor parallel,
    recompute, compile, data parallel; the schedule carries REDUCE_GRAD marks under dp; a compiled
    stage whose schedule runs B and W apart keeps its matrix-weight modules eager), then materialized:
    only this rank's slices and shards, from (seed, name) or `init_rule`
    (model.pretrained: models/hf.PretrainedWeights reads them from the folder's files). A model built
    for real is copied instead. `precision` is trainer.precision (fp32 | bf16); `fb_overlap`
    pipeline.fb_overlap (runtime/overlap.py)."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be {' or '.join(COMPUTE_DTYPES)} (got {precision!r})")
    compute_dtype = COMPUTE_DTYPES[precision]
    pl = schedule.placement
    if len(bounds) != pl.num_chunks:
        raise ValueError(f"the partition has {len(bounds)} chunks but the placement needs {pl.num_chunks}")
    # a compiled stage whose schedule runs B and W apart keeps its weight GEMMs out of its compiled graphs
    parallelize = dataclasses.replace(parallelize, apart=frozenset(
        s for s in pl.stages_of(rank) if parallelize.compiles(s) and split_on(schedule, [s])))
    device = torch.device(device)
    stages = {s: _stage(model, bounds[pl.chunk_of(s)], s, parallelize, device, seed, init_rule)
              for s in pl.stages_of(rank)}
    specs = model.boundary_specs(microbatch=microbatch_size, seq=seq_len)
    # context / sequence parallel: each rank sends and receives its (B, T/cp(/tp), C) part
    specs = [specs[0], *(dataclasses.replace(t, shape=parallelize.boundary_shape(t.shape)) for t in specs[1:-1]),
             specs[-1]]
    if compute_dtype is not None:
        specs = [dataclasses.replace(t, dtype=compute_dtype) if t.dtype.is_floating_point else t for t in specs]

    def recv_buffer(msg: Message) -> torch.Tensor:
        rng = bounds[pl.chunk_of(msg.stage)]
        return specs[rng.stop if msg.kind is Kind.ACT else rng.start].empty(device)

    def consumer_stage(msg: Message) -> int:
        other = pl.next_stage(msg.stage) if msg.kind is Kind.ACT else pl.prev_stage(msg.stage)
        assert other is not None
        return other

    t = transport
    comm = None
    if schedule.num_ranks > 1:
        comm = P2P(rank, num_microbatches=schedule.num_microbatches, timeout_s=t.timeout_s, group=t.group,
                   group_ranks=t.group_ranks, in_order=t.in_order, consumer_stage=consumer_stage,
                   pair_groups=_pair_groups(schedule, t, device))
    # The loss is averaged over every rank's microbatches: the whole world (every pipeline).
    dp = parallelize.dp
    sync = GradSync(stages, group=t.group, pipelines=t.pipelines)
    # copies summed during the step where nothing is reduced before the sum (data parallel's
    # reduction, tensor parallel's partial gradients: train_step runs those first), and not where all
    # streams share one hardware queue: an all-reduce waiting for its peer there would hold back the
    # point-to-point kernels queued after it, which that peer may need first
    early = sync.early(schedule, rank) if dp is None and parallelize.tp is None and not one_hw_queue(
        device.type) else {}
    executor = Executor(schedule, rank, stages, comm=comm, recv_buffer=recv_buffer, device=device,
                        loss_group=t.group if t.pipelines is None else None, lookahead=t.lookahead,
                        reducer=dp.reducer(stages) if dp is not None else None, compute_dtype=compute_dtype,
                        fb_overlap=fb_overlap, a2a_timeout_s=t.timeout_s, grads_done=early,
                        loss_parts=model.loss_parts)
    return RankPipeline(rank, schedule, stages, executor, sync, parallelize)


def rank_pipeline(config: Config, plan: Plan, groups: RankGroups, parallelize: Parallelize,
                  device: torch.device) -> tuple[RankPipeline, LayeredModel, list[str]]:
    """This rank's pipeline as `config` and `plan` (the schedule and the cut) make it, its transport
    over `groups`; also the model on the meta device (its shapes, for the data) and the
    model.pretrained files this rank read (its values, not the seeded init)."""
    torch.manual_seed(config.trainer.seed)  # dropout; weights come from (seed, name)
    model = build_model(config.model, device="meta")  # shapes only: each rank materializes its stages
    weights = pretrained_rule(config.model)
    pipe = build_rank_pipeline(
        model, plan.chunk_bounds, plan.schedule, groups.pp_rank, microbatch_size=config.microbatch_size,
        seq_len=config.data.seq_len, device=device, precision=config.trainer.precision, seed=config.trainer.seed,
        init_rule=weights, parallelize=parallelize, transport=Transport.of(config, groups),
        fb_overlap=config.pipeline.fb_overlap)
    if config.data.masks_documents:  # attention within each document: the executor cuts rows at this id
        pipe.executor.batch.document_eos = document_eos(config.data)
    if pipe.executor.comm is not None:  # its errors name global ranks and their pp / dp / tp coordinates
        pipe.executor.comm.name_ranks(config.layout)
    opened = [] if weights is None else weights.opened
    if weights is not None:
        weights.close()
    return pipe, model, opened


def document_eos(data: DataConfig) -> int:
    """The id that ends a document in `data`'s rows (data.document_mask): its tokenizer's EOS; data=sft's
    samples end at their own separator (train/hf_sft.py: chat turns may end at EOS)."""
    if data.name == "sft":
        from pipetrain.train.hf_sft import separator

        return separator(data.tokenizer_dir)
    eos = load_tokenizer(data.tokenizer_name, data.tokenizer_dir).eos_id
    if eos is None:
        raise ValueError(f"data.document_mask=true but data.tokenizer={data.tokenizer_name} has no end-of-text id to "
                         f"cut rows into documents: set data.document_mask=false")
    return eos


def _stage(model: LayeredModel, layers: range, stage_id: int, parallelize: Parallelize, device: torch.device,
           seed: Optional[int], rule: Optional[InitRule]) -> StageModule:
    """Cut, parallelize, materialize: a stage cut on meta is parallelized there and then allocated as
    this rank holds it (its tp slices and dp shards only); a real one is moved to `device` first."""
    stage = cut_stage(model, layers, stage_id=stage_id)
    meta = on_meta(stage)
    if meta and seed is None:
        raise ValueError(f"stage {stage_id}: the model was built on the meta device: pass seed= to initialise it")
    if not meta:
        stage.to(device)
    stage = parallelize.apply(stage)
    if meta:
        assert seed is not None
        held = parallelize.split_weights({stage_id: stage})
        materialize(stage, rule or model, held, seed=seed, device=device, canonical=stage.tied)
    return stage
