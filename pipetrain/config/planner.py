"""Schema of the `plan` config group: what `mode=plan` and `schedule=auto` search over (pure: no torch).

The planner (pipetrain/planner/) scores every (pp x dp x cp x tp layout (ep within dp), schedule, v, M, microbatch size,
recompute) of this space by simulation against a per-device memory budget, and ranks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipetrain.config.devices import CATALOG, LOCAL, device_spec

OBJECTIVES = ("tokens_per_s", "tokens_per_s_per_gb")
PLAN_PARTITIONS = ("uniform", "params", "flops", "balanced", "profile")  # the strategies a plan can cut by
ATTENTION = ("flash", "materialized")  # plan.attention: how the planned run's attention kernel is costed


@dataclass
class PlannerConfig:
    # ranks to plan for; null = plan.nodes x plan.devices_per_node, else the configured layout's
    world_size: Optional[int] = None
    # the accelerator planned for (config/devices.py's catalog: a100-40gb, a100-80gb, h100-sxm, h800, h200, b200,
    # mi300x): layer times from GEMM shapes on it, links from its node; local: plan.tflops and the plan.*_gbs links
    device: str = LOCAL
    nodes: int = 1  # with plan.devices_per_node, the world when plan.world_size is null
    # devices (ranks) per node; null = plan.device's node (8 in every catalog entry), unknown for local
    devices_per_node: Optional[int] = None
    memory_gb: Optional[float] = None  # memory budget per device, GB (10^9 bytes); null = plan.device's, 80 for local
    fp8: bool = False  # with plan.device: the linear layers' GEMMs at its fp8 peak (Float8 training), casts by bytes
    # with plan.device: attention as one fused kernel (flash) or as its GEMMs with the s x s scores written out
    # and read back by softmax, mask and dropout (materialized, Megatron-LM 2021's kernels)
    attention: str = "flash"
    # with plan.device: element-wise ops as fused kernels (torch.compile, Megatron's fused kernels); false: one
    # kernel per op, as eager PyTorch runs them (about 3x the bytes)
    fused_elementwise: bool = True
    # share of a stage's last backward its data-parallel reduction runs under (bucket by bucket as layers finish:
    # torchtitan's FSDP2, Megatron's --overlap-grad-reduce); 0 = pipetrain's run, which starts a stage's
    # reduction at its REDUCE_GRAD, after the stage's last weight gradient
    grad_overlap: float = 0.0
    global_batch: Optional[int] = None  # sequences per optimizer step; null = data.batch_size
    tflops: Optional[float] = None  # sustained TFLOP/s turning real models' FLOPs into ms; null = sim.tflops
    p2p_gbs: float = 25.0  # stage-to-stage bandwidth, GB/s (a stage boundary tensor per transfer)
    p2p_latency_ms: Optional[float] = None  # per transfer; null = sim.comm_ms
    dp_gbs: Optional[float] = None  # per-rank gradient-reduction bandwidth, GB/s; null = cluster.dp_bandwidth_gbs
    optim_gbs: float = 0.0  # memory bandwidth of the optimizer step, GB/s (0: the step is not timed)
    # framework time per F, B, W or BW action beyond its layers' (fitted by plan.calibrate)
    action_overhead_ms: float = 0.0
    # framework time per layer and op (F, B, W) beyond the model's costs (fitted by plan.calibrate)
    layer_overhead_ms: float = 0.0
    # fixed cost of each stage's data-parallel gradient reduction (calibrated like the above)
    reduce_latency_ms: float = 0.0
    # fixed cost per optimizer step outside the pipeline (loss, grad norm, optimizer launch)
    step_overhead_ms: float = 0.0
    # fixed cost of each tensor-parallel collective (fitted by plan.calibrate when plan.tp lists tp > 1)
    tp_latency_ms: float = 0.0
    # time layers and train short runs here to fit the overheads above; null = on for schedule=auto
    # training on local CPU ranks
    calibrate: Optional[bool] = None
    calibrate_steps: int = 5  # steps of each calibration run (the first is warm-up and not counted)
    margin: float = 0.05  # fraction of the predicted peak added for fragmentation and workspaces
    # GB per GPU outside the caching allocator (CUDA context, NCCL's communicator buffers), added to every
    # row's peak; null = 1.5 where the ranks train on CUDA (trainer.device, auto resolved here), 0 on CPU
    gpu_overhead_gb: Optional[float] = None
    w_keep: float = 1.0  # share of a microbatch's activations B keeps for W (1: all, the safe bound)
    schedules: Optional[list[str]] = None  # schedules to try; null = every built-in
    pp: Optional[list[int]] = None  # pipeline degrees to try; null = every divisor of the world
    # tensor-parallel degrees to try (world = pp x dp x tp); null = [1], with plan.device every power of two up to
    # its node that divides the model's split dimensions
    tp: Optional[list[int]] = None
    # rows with tp > 1 also split activations on the sequence (parallel.sequence_parallel)
    sequence_parallel: bool = False
    # expert-parallel degrees to try (ep borrows dp's ranks, its rows FSDP2-sharded); null = for an MoE model
    # every divisor of model.moe.num_experts, for a dense one [1]
    ep: Optional[list[int]] = None
    # context-parallel degrees to try (world = pp x dp x cp x tp; Llama family, data.seq_len a multiple of
    # 2 cp); [1]: context parallel pays at long sequences, so it is searched where listed
    cp: list[int] = field(default_factory=lambda: [1])
    virtual_stages: list[int] = field(default_factory=lambda: [2])  # v for interleaved_1f1b / looped_bfs
    microbatch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # sequences per microbatch
    recompute: list[bool] = field(default_factory=lambda: [False])  # trainer.activation_checkpointing values to try
    # with true in plan.recompute: also recompute on the first k pipeline ranks only (k = 1..pp-1), the
    # ranks a 1F1B-like schedule fills with the most microbatches (trainer.recompute_stages)
    recompute_partial: bool = False
    # with true in plan.recompute: also try each recompute row with trainer.recompute=selective
    # (trainer.recompute_modules, only those modules recomputed, in B) beside full recompute
    recompute_selective: bool = False
    # dp > 1 as FSDP2 shards (parallel.dp_shard) instead of replicas; null = replicas, and with plan.device, where a
    # model's weights and optimizer state do not fit one device, FSDP2 rows first and replicated rows where they fit
    dp_shard: Optional[bool] = None
    # partition strategies to try (uniform, params, flops, balanced, profile: by measured time, with
    # partition=profile); null = the configured partition's. Rows of two strategies that cut alike are one row
    partitions: Optional[list[str]] = None
    max_microbatches: int = 256  # skip candidates with more microbatches
    objective: str = "tokens_per_s"  # tokens_per_s | tokens_per_s_per_gb
    time_limit_s: float = 60.0  # stop simulating candidates after this long (the rest are listed unevaluated)
    prune: bool = True  # skip simulating a candidate whose lower bound cannot beat the best so far
    top: int = 20  # rows shown in the console table (plan.json and plan.csv hold all)
    run: bool = False  # plan, then train the best row (same as schedule=auto)

    def __post_init__(self) -> None:
        for knob in ("world_size", "devices_per_node", "global_batch"):
            value = getattr(self, knob)
            if value is not None and value < 1:
                raise ValueError(f"plan.{knob} must be >= 1 (got {value})")
        if self.nodes < 1 or self.top < 1 or self.max_microbatches < 1:
            raise ValueError("plan.nodes, plan.top and plan.max_microbatches must be >= 1")
        self._check_world()
        if self.calibrate_steps < 2:
            raise ValueError(
                f"plan.calibrate_steps must be >= 2: the first step is warm-up (got {self.calibrate_steps})")
        if self.device != LOCAL:
            device_spec(self.device)  # an unknown name: one line listing the catalog
        if self.attention not in ATTENTION:
            raise ValueError(f"plan.attention={self.attention!r} is unknown: choose one of {', '.join(ATTENTION)}")
        if not 0.0 <= self.grad_overlap <= 1.0:
            raise ValueError(f"plan.grad_overlap must be in [0, 1] (got {self.grad_overlap})")
        if self.fp8 and (self.device == LOCAL or not CATALOG[self.device].fp8_tflops):
            raise ValueError(f"plan.fp8=true needs a plan.device with fp8 tensor cores (plan.device={self.device}): "
                             f"set plan.device to one of {', '.join(n for n, d in CATALOG.items() if d.fp8_tflops)}")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise ValueError(f"plan.memory_gb must be > 0 (got {self.memory_gb})")
        for knob in ("p2p_gbs", "time_limit_s"):
            if not getattr(self, knob) > 0:
                raise ValueError(f"plan.{knob} must be > 0 (got {getattr(self, knob)})")
        if self.dp_gbs is not None and not self.dp_gbs > 0:
            raise ValueError(f"plan.dp_gbs must be > 0 (got {self.dp_gbs})")
        for knob in ("optim_gbs", "margin", "action_overhead_ms", "layer_overhead_ms", "reduce_latency_ms",
                     "step_overhead_ms", "tp_latency_ms"):
            if getattr(self, knob) < 0:
                raise ValueError(f"plan.{knob} must be >= 0 (got {getattr(self, knob)})")
        if (self.gpu_overhead_gb or 0) < 0:
            raise ValueError(f"plan.gpu_overhead_gb must be >= 0 (got {self.gpu_overhead_gb})")
        if (self.p2p_latency_ms or 0) < 0:
            raise ValueError(f"plan.p2p_latency_ms must be >= 0 (got {self.p2p_latency_ms})")
        if not 0.0 <= self.w_keep <= 1.0:
            raise ValueError(f"plan.w_keep must be in [0, 1] (got {self.w_keep})")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"plan.objective={self.objective!r} is unknown: choose one of {', '.join(OBJECTIVES)}")
        if not self.microbatch_sizes or min(self.microbatch_sizes) < 1:
            raise ValueError("plan.microbatch_sizes must list sizes >= 1")
        for knob, what in (("tp", "tensor"), ("ep", "expert"), ("cp", "context")):
            degrees = getattr(self, knob)
            if degrees is not None and (not degrees or min(degrees) < 1):
                raise ValueError(f"plan.{knob} must list {what}-parallel degrees >= 1 (got {degrees})")
        if not self.virtual_stages or min(self.virtual_stages) < 2:
            raise ValueError("plan.virtual_stages must list v >= 2 (for interleaved_1f1b / looped_bfs)")
        if not self.recompute:
            raise ValueError("plan.recompute must list at least one of true, false")
        if self.partitions is not None:
            unknown = [n for n in self.partitions if n not in PLAN_PARTITIONS]
            if unknown or not self.partitions:
                raise ValueError(f"plan.partitions={self.partitions} must list strategies from "
                                 f"{', '.join(PLAN_PARTITIONS)} (partition=manual's cut is not searched)")

    @property
    def memory_budget_gb(self) -> float:
        """plan.memory_gb, its null resolved: plan.device's memory, 80 GB for local."""
        if self.memory_gb is not None:
            return self.memory_gb
        return 80.0 if self.device == LOCAL else CATALOG[self.device].memory_gb

    @property
    def node_size(self) -> Optional[int]:
        """plan.devices_per_node, its null resolved from plan.device's node (None for local)."""
        if self.devices_per_node is not None or self.device == LOCAL:
            return self.devices_per_node
        return CATALOG[self.device].devices_per_node

    def _check_world(self) -> None:
        """plan.world_size, where given, must be the machines it plans for: the planner would
        otherwise lay out a world that plan.nodes x plan.devices_per_node does not have."""
        world, nodes, per_node = self.world_size, self.nodes, self.devices_per_node
        if world is None:
            return
        if per_node is not None and world != nodes * per_node:
            raise ValueError(f"plan.world_size={world} is not plan.nodes={nodes} x plan.devices_per_node={per_node} "
                             f"= {nodes * per_node}: set plan.world_size={nodes * per_node} (or null, their product), "
                             f"or change plan.nodes / plan.devices_per_node")
        if per_node is None and world % nodes:
            raise ValueError(f"plan.world_size={world} ranks do not split evenly over plan.nodes={nodes}: set "
                             f"plan.nodes to a divisor of {world}, or plan.devices_per_node instead of plan.world_size")
