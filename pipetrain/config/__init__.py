"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

Hydra composes YAML from `conf/` (and recipes) on top of these schemas, so a
misspelled key or a value of the wrong type fails during composition with a
message naming the key. Cross-field rules live in `__post_init__` and raise a
one-line `ValueError` naming the knob to change. Past the CLI layer only these
dataclasses travel; no DictConfig.

Every schema of the product lives in this package (cluster.py, data.py, logs.py, profile.py, train.py
for the groups with their own rules, models.py for the model families; the root here), and the arrows
point one way: launch/, train/, loggers/ import these schemas; the schemas import none of
them, only the pure schedule registry and partition rules they check against. Pure Python:
nothing here imports torch, so composing and checking a config (and simulating the sleep
model) never loads it; importing it registers nothing in Hydra or OmegaConf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional


from pipetrain.config.cluster import ONE_QUEUE, ClusterConfig, one_hw_queue
from pipetrain.config.data import DataConfig
from pipetrain.config.deepseek import DeepSeekModelConfig
from pipetrain.config.finetune import pretrained_defaults
from pipetrain.config.logs import LoggingConfig, default_loggers
from pipetrain.config.llama import LlamaModelConfig
from pipetrain.config.mtp import check_mtp
from pipetrain.config.models import MISSING, GPT2ModelConfig, MLPModelConfig, ModelConfig, SleepModelConfig
from pipetrain.config.options import DEEPSEEK_OPTIONS, LLAMA_OPTIONS, MODEL_OPTIONS, MOE_OPTIONS  # noqa: F401
from pipetrain.config.profile import ProfileConfig
from pipetrain.config.parallel import ParallelConfig, check_experts, fill_dp_shard, launched_world, world_text
from pipetrain.config.run import CheckpointConfig, LaunchConfig, RunConfig
from pipetrain.config.planner import PlannerConfig
from pipetrain.config.token_origin import check_origin
from pipetrain.config.train import ExportConfig, OptimConfig, TrainerConfig
from pipetrain.parallel.layout import Layout
from pipetrain.partition.strategies import manual_bounds
from pipetrain.schedules import registry
from pipetrain.schedules.p2p import TRANSPORT_STREAMS


class Mode(str, enum.Enum):
    train = "train"
    simulate = "simulate"
    eval = "eval"  # mean next-token loss on a token file, on the pipeline ranks (train/evaluate.py)
    export = "export"  # the model as a Hugging Face folder, in this process (train/export.py)
    plan = "plan"  # rank layouts, schedules and microbatching by simulation (planner/cmd.py)


FB_OVERLAP = ("off", "auto", "on")  # pipeline.fb_overlap


@dataclass
class PipelineConfig:
    degree: int = 2  # P: pipeline ranks
    microbatches: int = 8  # M: microbatches per optimizer step, for every schedule
    # longest wait for a peer's tensor before the rank fails (NCCL: the pair groups' watchdog)
    p2p_timeout_s: float = 300.0
    # Receives are posted this many actions before the action that consumes them (0 = just in
    # time); receive buffers alive per rank stay <= lookahead + 1, whatever the microbatch count.
    p2p_lookahead: int = 1
    # A 2-rank process group (an NCCL communicator and stream) per pair of ranks that exchange tensors,
    # so a send never queues behind a receive from another peer (pair_groups), or the pipeline's one
    # process group, whose NCCL stream runs a rank's groups to all peers in issue order (one_group:
    # plans that would deadlock there are refused before any process starts).
    p2p_transport: str = "pair_groups"
    # gloo behaves like NCCL under p2p_transport: in-order streams (one per pair of ranks, or one per
    # rank for one_group), messages matched by position (tests use it to catch what would deadlock or
    # mismatch on GPUs). Slower.
    p2p_in_order: bool = False
    # DualPipe's F&B overlap (runtime/overlap.py): off = each F&B pair runs its forward, then its
    # backward; auto = MoE stages under expert parallel run node by node with the pair's nodes
    # interleaved (all-to-alls hidden under the other microbatch's compute; on GPUs on a stream of
    # their own), whole stages where they cannot; on = the same, refused in one line where it cannot
    # (parallel.ep=1, trainer.recompute=full, CUDA_DEVICE_MAX_CONNECTIONS=1).
    fb_overlap: str = "off"

    def __post_init__(self) -> None:
        if self.fb_overlap not in FB_OVERLAP:
            raise ValueError(f"pipeline.fb_overlap must be {' or '.join(FB_OVERLAP)} (got {self.fb_overlap!r})")
        if self.degree < 1:
            raise ValueError(f"pipeline.degree must be >= 1 (got {self.degree})")
        if self.microbatches < 1:
            raise ValueError(f"pipeline.microbatches must be >= 1 (got {self.microbatches})")
        if not self.p2p_timeout_s >= 0.001:  # gloo counts whole milliseconds: less would mean no timeout at all
            raise ValueError(f"pipeline.p2p_timeout_s must be >= 0.001 seconds (1 ms, got {self.p2p_timeout_s})")
        if self.p2p_lookahead < 0:
            raise ValueError(f"pipeline.p2p_lookahead must be >= 0 actions (got {self.p2p_lookahead})")
        if self.p2p_transport not in TRANSPORT_STREAMS:
            raise ValueError(f"pipeline.p2p_transport must be {' or '.join(TRANSPORT_STREAMS)} "
                             f"(got {self.p2p_transport!r})")


AUTO = "auto"  # schedule=auto: plan (mode=plan's search), then train the best row


@dataclass
class ScheduleConfig:
    name: str = "1f1b"  # the schedule= option: a built-in schedule, or custom for schedule.path
    virtual_stages: int = 1  # v: stages per rank (interleaved / looped BFS; V and mirror fix it at 2)
    path: Optional[str] = None  # schedule=custom: a .csv or .txt file
    placement: str = "loop"  # schedule=custom: loop | v | mirror
    # schedule=zb_auto: live activation sets per rank, one value for all ranks or one per rank;
    # null = 2*degree-1 (ZB-H2's)
    memory_budget: Optional[list[float]] = None
    w_keep: float = 1.0  # schedule=zb_auto: share of a microbatch's activations B keeps for W (1: all, until W)

    def __post_init__(self) -> None:
        if self.name == registry.CUSTOM:
            if not self.path:
                raise ValueError("schedule=custom needs a file: add schedule.path=my_schedule.csv")
        elif self.name != AUTO:  # schedule=auto: the planner picks the schedule before the run (planner/auto.py)
            registry.get(self.name)  # unknown names fail here with the list of choices
            if self.path:
                raise ValueError(f"schedule.path is only read by schedule=custom (got schedule={self.name}): "
                                 f"drop schedule.path or set schedule=custom")
        if self.virtual_stages < 1:
            raise ValueError(f"schedule.virtual_stages must be >= 1 (got {self.virtual_stages})")
        if self.memory_budget is not None and (not self.memory_budget or min(self.memory_budget) < 1):
            raise ValueError(f"schedule.memory_budget must list budgets >= 1 microbatch of activations "
                             f"(one for all ranks or one per rank), e.g. [7] (got {self.memory_budget})")
        if not 0.0 <= self.w_keep <= 1.0:
            raise ValueError(f"schedule.w_keep must be in [0, 1] (got {self.w_keep})")


# ---- data, partition, simulator -----------------------------------------------------------

# `profile` measures each layer on this machine and balances the measured time; the others
# are pipetrain.partition.strategies.partition's strategies of the same name.
PARTITIONS = ("uniform", "params", "flops", "profile", "balanced", "manual")


@dataclass
class PartitionConfig:
    name: str = "uniform"  # the partition= option: how the layers are cut into stages
    boundaries: Optional[list[int]] = None  # partition=manual: first layer index of stages 1..k-1

    def __post_init__(self) -> None:
        if self.name not in PARTITIONS:
            raise ValueError(f"partition={self.name!r} is unknown: choose partition= one of {', '.join(PARTITIONS)}")
        if self.boundaries is not None and self.name != "manual":
            raise ValueError(
                f"partition.boundaries is only read by partition=manual (got partition={self.name}): "
                "set partition=manual or drop partition.boundaries"
            )


@dataclass
class SimConfig:
    comm_ms: float = 0.0  # point-to-point latency added to every cross-rank dependency
    fb_overlap: float = 0.0  # an F&B pair costs (F + BW) * (1 - fb_overlap)
    # Sustained TFLOP/s that turns a real model's analytic FLOPs into ms (not used by
    # model=sleep or partition=profile, whose times are given or measured). 100 is one
    # A100 (312 TFLOP/s bf16 peak) at the ~30-40% MFU that GPT-2-sized training sustains
    # (Megatron / nanoGPT report that range); every time scales by the same factor, so the
    # partition, imbalance and bubble fractions do not depend on it, only the ms shown
    # (and how much sim.comm_ms weighs against compute).
    tflops: float = 100.0
    timeline: bool = True  # print the per-rank timeline
    timeline_width: int = 0  # columns for the timeline; 0 = the terminal's width

    def __post_init__(self) -> None:
        if self.comm_ms < 0:
            raise ValueError(f"sim.comm_ms must be >= 0 (got {self.comm_ms})")
        if not 0.0 <= self.fb_overlap < 1.0:
            raise ValueError(f"sim.fb_overlap must be in [0, 1) (got {self.fb_overlap})")
        if not self.tflops > 0:
            raise ValueError(f"sim.tflops must be > 0 (got {self.tflops}): the sustained TFLOP/s of one device")


# ---- root ---------------------------------------------------------------------------------


@dataclass
class Config:
    mode: Mode = Mode.simulate  # train | simulate | eval | export (conf/config.yaml sets train)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    model: Any = MISSING  # one of the model schemas (SleepModelConfig, GPT2ModelConfig, ...)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    plan: PlannerConfig = field(default_factory=PlannerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: list[str] = field(default_factory=default_loggers)  # logger=[console,jsonl,trace,wandb]
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # profile.enabled=true: torch.profiler traces

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"model= must name a model config: choose model= one of {', '.join(MODEL_OPTIONS)}")
        # data.tokenizer and optim.lr / min_lr / warmup_steps left null: a fine-tune's, or pre-training's
        pretrained_defaults(self.model.pretrained, self.data, self.optim,
                            steps=self.optim.decay_steps or self.trainer.max_steps)
        s, p = self.schedule, self.pipeline
        if s.name not in (registry.CUSTOM, AUTO):
            registry.check(s.name, p.degree, p.microbatches, s.virtual_stages)
        if s.name != AUTO:  # the planner's row is checked when it is applied
            self._check_layers()
        if self.parallel.dp_shard == -1:
            world = self.cluster.fixed_world() or launched_world(self.cluster.name)
            self.parallel.dp_shard = fill_dp_shard(self.parallel, degree=p.degree, world=world,
                                                   where=f"cluster={self.cluster.name}")
        self._check_data()
        self._check_parallel()
        self._check_recompute()
        self.logging.check(self.logger, max_steps=self.trainer.max_steps)
        self.profile.check(max_steps=self.trainer.max_steps)
        # SLURM: nodes x ranks per node must be the world
        self.cluster.check_world(self.layout.world, world_text(*self.layout.shape))
        self.cluster.check_device(self.trainer.device)  # NCCL with the CPU, gloo with CUDA: refused here
        if self.partition.name == "manual":  # the strategy's own message, with an example for this model
            manual_bounds(self.model.num_layers, self.num_chunks, self.partition.boundaries)

    @property
    def num_chunks(self) -> int:
        """Model chunks the schedule's placement cuts the model into (degree x stages per rank)."""
        s = self.schedule
        return registry.placement_for(
            s.name, self.pipeline.degree, s.virtual_stages, custom_placement=s.placement
        ).num_chunks

    @property
    def layout(self) -> Layout:
        """The parallel layout: pipeline.degree x parallel.dp_replicate x parallel.dp_shard x parallel.cp x
        parallel.tp ranks (the experts folded over them: parallel.ep x parallel.etp x edp)."""
        par = self.parallel
        return Layout(self.pipeline.degree, par.dp_replicate, par.dp_shard, par.tp, par.ep, par.cp, par.etp or 0)

    @property
    def microbatch_size(self) -> int:
        """Sequences in one microbatch of one pipeline: data.batch_size / (dp x pipeline.microbatches)
        (at least 1: model=sleep in mode=simulate does not require the batch to divide)."""
        return max(1, self.data.batch_size // (self.parallel.dp * self.pipeline.microbatches))

    def _check_layers(self) -> None:
        s, m, chunks = self.schedule, self.model, self.num_chunks
        if chunks <= m.num_layers:
            return
        free_v = s.name == registry.CUSTOM or registry.get(s.name).fixed_stages_per_rank is None
        lower = "pipeline.degree or schedule.virtual_stages" if free_v and s.virtual_stages > 1 else "pipeline.degree"
        extra = m.extra_layers  # GPT-2's and Llama's embedding and head are layers too
        raise ValueError(
            f"schedule {s.name} with pipeline.degree={self.pipeline.degree} cuts the model into {chunks} stages "
            f"but model={m.name} has {m.num_layers} layers: lower {lower}, or raise {m.layer_knob} "
            f"to >= {chunks - extra}"
        )

    def _check_parallel(self) -> None:
        par = self.parallel
        if par.param_dtype is not None and par.dp_shard == 1:
            raise ValueError(
                f"parallel.param_dtype={par.param_dtype} is read only by FSDP2 (parallel.dp_shard > 1): "
                f"drop it, or use trainer.precision for the compute dtype"
            )
        for knob, value, default in (("reduce_dtype", par.reduce_dtype, "float32"),
                                     ("overlap_reduce", par.overlap_reduce, True)):
            if value != default and par.dp == 1:
                raise ValueError(
                    f"parallel.{knob}={str(value).lower() if isinstance(value, bool) else value} does nothing without "
                    f"data parallel: drop it or set parallel.dp_replicate / parallel.dp_shard > 1"
                )
        if par.tp > 1:
            self._check_tp()
        if self.pipeline.fb_overlap == "on" and self.mode is Mode.train:  # simulate and plan price it as a what-if
            self._check_fb_overlap()
        if par.ep > 1 or par.etp is not None or (par.tp > 1 and self.model.moe_config is not None):
            self._check_ep()
        if par.cp > 1:
            self._check_cp()
        elif par.cp_rotate != "allgather" and max(self.plan.cp) == 1:  # the planner prices plan.cp's rows with it
            raise ValueError(f"parallel.cp_rotate={par.cp_rotate} passes K/V between context-parallel ranks, which "
                             f"this run has none of (parallel.cp=1): set parallel.cp > 1 or drop parallel.cp_rotate")

    def _check_recompute(self) -> None:
        """Selective recompute wraps the modules a model's layers declare: without any it would run as none."""
        m, t = self.model, self.trainer
        if m.selective_recompute:
            return
        knob, fix = (("trainer.recompute=selective", "trainer.recompute=full or none") if t.recompute == "selective"
                     else ("plan.recompute_selective=true", "plan.recompute_selective=false")
                     if self.mode is Mode.plan and self.plan.recompute_selective else (None, None))
        if knob:
            raise ValueError(f"{knob}: model={m.name} ({m.family}) declares no module to recompute selectively "
                             f"(GPT-2's LayerNorms and GELU keep only their inputs, as a recomputed call would; the "
                             f"Llama family and DeepSeek declare theirs): set {fix}")

    def _check_cp(self) -> None:
        """Context parallel splits every sequence into 2 cp load-balanced chunks inside Llama's attention."""
        cp, par, m = self.parallel.cp, self.parallel, self.model
        if m.family not in ("llama", "deepseek"):
            raise ValueError(f"parallel.cp={cp} splits sequences inside Llama-family attention but model={m.name} is "
                             f"{m.family}: set parallel.cp=1 or choose a Llama-family or DeepSeek model")
        if self.data.seq_len % (2 * cp):
            raise ValueError(f"parallel.cp={cp} cuts data.seq_len={self.data.seq_len} into {2 * cp} equal chunks (load "
                             f"balance): set data.seq_len to a multiple of {2 * cp}")
        if par.sequence_parallel and (self.data.seq_len // cp) % par.tp:  # SP splits a cp rank's positions
            raise ValueError(f"parallel.sequence_parallel splits each cp rank's {self.data.seq_len // cp} positions "
                             f"across parallel.tp={par.tp} ranks: set data.seq_len to a multiple of "
                             f"{cp * (2 * par.tp if par.tp % 2 else par.tp)}")

    def _check_fb_overlap(self) -> None:
        """F&B overlap hides expert-parallel all-to-alls in stages run node by node (runtime/nodes.py), which full
        recompute (whole layers re-run in the backward) does not allow; on GPUs its stream needs a hardware queue."""
        if self.parallel.ep == 1:
            raise ValueError("pipeline.fb_overlap=on hides expert-parallel all-to-alls, which this run has none of "
                             "(parallel.ep=1): set pipeline.fb_overlap=auto or off, or parallel.ep > 1")
        if self.trainer.activation_checkpointing:  # selective recompute runs inside the nodes: allowed
            raise ValueError("pipeline.fb_overlap=on runs stages node by node; trainer.recompute=full (or "
                             "trainer.activation_checkpointing=true) re-runs whole layers: set trainer.recompute="
                             "selective or none, or pipeline.fb_overlap=auto")
        if one_hw_queue(self.trainer.device):  # each rank checks again (runtime/overlap.py node_execution)
            raise ValueError(ONE_QUEUE)

    def _check_ep(self) -> None:
        """Expert parallel folds over dp_shard x cp (and tp) and splits every MoE layer's experts evenly."""
        moe = self.model.moe_config  # the MoE knobs of a model family that has them
        check_experts(self.parallel, None if moe is None else moe.num_experts, model=self.model.name)

    def _check_tp(self) -> None:
        """Every dimension tensor parallel splits must split evenly (one line naming the knob)."""
        tp, m = self.parallel.tp, self.model
        divides = m.tp_divides()
        if divides is None:
            if isinstance(m, SleepModelConfig) and self.mode is Mode.simulate:
                return  # the simulator divides its configured times by tp (schedules/tp_cost.py)
            raise ValueError(f"parallel.tp={tp}: model={m.name} has no tensor-parallel plan (GPT-2, the Llama family "
                             f"and DeepSeek have one): set parallel.tp=1")
        for knob, value in divides.items():
            if value % tp:
                raise ValueError(f"parallel.tp={tp} must divide model.{knob}={value}: set parallel.tp to a divisor "
                                 f"of {value}")
        if self.parallel.sequence_parallel and self.data.seq_len % tp:
            raise ValueError(f"parallel.sequence_parallel splits the sequence across parallel.tp={tp} ranks but "
                             f"data.seq_len={self.data.seq_len} does not divide: "
                             f"set data.seq_len to a multiple of {tp}")

    def _check_data(self) -> None:
        d, m, mb, dp = self.data, self.model, self.pipeline.microbatches, self.parallel.dp
        if (m.needs_batch or self.mode in (Mode.train, Mode.eval)) and d.batch_size % (mb * dp):
            up = -(-d.batch_size // (mb * dp)) * mb * dp
            if dp == 1:
                raise ValueError(
                    f"data.batch_size={d.batch_size} does not split into pipeline.microbatches={mb} equal "
                    f"microbatches: set data.batch_size to a multiple of {mb} (e.g. {up}) or pipeline.microbatches "
                    f"to a divisor of it"
                )
            raise ValueError(
                f"data.batch_size={d.batch_size} (the global batch) does not split into dp={dp} pipelines x "
                f"pipeline.microbatches={mb} equal microbatches: set data.batch_size to a multiple of {mb * dp} "
                f"(e.g. {up}), or lower pipeline.microbatches or the dp degrees"
            )
        if self.mode is Mode.eval and d.name not in ("tokens", "datasets"):  # the ranks refused it only once started
            raise ValueError(f"mode=eval reads token files or data=datasets' validation rows: set data=tokens "
                             f"data.path=FILE or data=datasets (got data={d.name})")
        if self.mode is Mode.eval and d.name == "datasets" and d.streaming:  # train/evaluate.py reads the cache
            raise ValueError("mode=eval reads each validation row once from the token cache: set data.streaming=false")
        if d.masks_documents:  # the model attends within documents
            d.check_document_mask(model=m.name, family=m.family, compile=self.trainer.compile)
        vocab = m.vocab_size
        if vocab is not None and self.mode is not Mode.simulate:  # a simulation reads no tokens
            d.check_vocab_fits(vocab)  # token files' ids: train/token_check.py, before the ranks start
        if self.mode is not Mode.simulate:
            check_origin(d)  # token shards whose record names another tokenizer than the run's
        longest = getattr(m, m.seq_knob) if m.has_seq else None
        if longest is not None and d.seq_len > longest:
            raise ValueError(f"data.seq_len={d.seq_len} exceeds model.{m.seq_knob}={longest} of model={m.name}: "
                             f"set data.seq_len <= {longest}")
        check_mtp(m.mtp_config, model=m.name, data=d, parallel=self.parallel, compile=self.trainer.compile)


# Schemas by ConfigStore name (`<name>_schema` in group `model`): every conf/model/gpt2*.yaml composes on
# gpt2_schema and sets its size, the Llama-family presets on llama_schema, DeepSeek's on deepseek_schema.
MODEL_SCHEMAS: dict[str, type] = {"sleep": SleepModelConfig, "mlp": MLPModelConfig, "gpt2": GPT2ModelConfig,
                                  "llama": LlamaModelConfig, "deepseek": DeepSeekModelConfig}


def register_configs() -> None:
    """Schemas in the ConfigStore: `config_schema` for the root, `<model>_schema` per model schema."""
    from hydra.core.config_store import ConfigStore  # here, not at import: the ranks read schemas, not Hydra

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="model", name=f"{name}_schema", node=schema)
