"""What the planner plans for: a model's work (`Workload`, per-layer costs by microbatch size and the
sizes memory needs) and the device it runs on (`Device`, its memory and links, and the overheads a
run adds: planner/calibrate.py). Pure Python, no torch: planner/cmd.py builds both from a Config,
planner/search.py scores candidates with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pipetrain.config.devices import DeviceSpec
from pipetrain.partition.costs import LayerCost
from pipetrain.planner.memory import StateBytes


@dataclass(frozen=True)
class Workload:
    """What the planner needs of a model: per-layer costs for a microbatch size, and sizes."""

    layers: Callable[[int], Sequence[LayerCost]]  # microbatch size -> per-layer costs of one microbatch
    seq: int  # tokens per sequence (1 for models without a sequence axis)
    boundary_bytes_per_token: float  # the tensor crossing a stage boundary, per token
    state: StateBytes = StateBytes()
    w_keep: float = 1.0  # share of a microbatch's activations B keeps for W
    # what activation recompute keeps per token of the first layer's input (token ids: 8 bytes);
    # None: the boundary tensor, like every other layer's input
    input_bytes_per_token: Optional[float] = None
    # the inputs of the first stage's other layers, per token: the embedding's output in the parameters'
    # dtype (the first stage's residual stream stays fp32 under bf16 autocast, where a later stage's,
    # started from a bf16 boundary tensor, stays bf16); None: the boundary tensor
    first_stage_bytes_per_token: Optional[float] = None
    # microbatch size -> per layer, what the layer saves in the first stage over what `layers` says
    # (bf16 autocast: the first stage's residual stream stays fp32, a later stage's is bf16); None: 1
    first_stage_activation_ratio: Optional[Callable[[int], Sequence[float]]] = None
    # tensor parallel (schedules/tp_cost.py): a block's width, the vocabulary, bytes per value of the
    # tp collectives, and the activation bytes per token of a block that tp leaves whole without
    # sequence parallel (the norms' inputs and outputs; Korthikanti et al. 2022's 10 of 34)
    hidden: int = 0
    vocab: int = 0
    value_bytes: int = 4
    tp_replicated_bytes_per_token: float = 0.0
    # what the loss saves per token beyond the last layer's own (a causal LM's log-softmax and targets):
    # kept per microbatch in flight on the last stage with or without recompute (it runs outside the
    # checkpointed layers); `layers` leaves it out of the last layer
    loss_bytes_per_token: float = 0.0
    recompute_modules: tuple[str, ...] = ()  # trainer.recompute_modules: what a selective row recomputes
    # per layer, bytes per microbatch in flight of the bf16 copies autocast makes of its Linear weights
    # (models/profile.autocast_weight_bytes; empty: none); `layers` leaves them out. FSDP2 rows compute
    # in bf16 parameters and make none
    weight_copy_bytes: tuple[float, ...] = ()
    fsdp_casts: bool = False  # FSDP2 rows keep the copies too (parallel.param_dtype set to fp32 under bf16)
    # per tied weight (embedding and head): the layers holding a copy, its numel (GradSync sums copies across ranks)
    tied: tuple[tuple[tuple[int, ...], int], ...] = ()
    # per token, what the loss's backward allocates at once on the last stage (a causal LM's cross-entropy:
    # the fp32 gradients of its log-softmax output and input, 2 x 4 bytes x vocab, beside the saved output)
    loss_grad_bytes_per_token: float = 0.0
    # plan.device: (microbatch size, tp, cp, sequence parallel) -> per-layer costs timed at one tp x cp rank's
    # shapes, scaled to the whole layer (planner/compute.py); None: `layers` for every degree
    sharded_layers: Optional[Callable[[int, int, int, bool], Sequence[LayerCost]]] = None
    # FLOPs per token of the whole model as MFU counts them (3 x each layer's forward: 6 x parameters + attention),
    # and those a full recompute adds (the blocks' forward again, as Megatron-LM's 96 B s l h^2 count has it)
    model_flops_per_token: float = 0.0
    recompute_flops_per_token: float = 0.0
    params: float = 0.0  # the whole model's parameters (a tied copy counted where it is stored)


@dataclass(frozen=True)
class Device:
    """One device and its links."""

    memory_gb: float  # budget per device
    p2p_gbs: float = 25.0  # stage-to-stage bandwidth, GB/s
    p2p_latency_ms: float = 0.0  # per transfer
    dp_gbs: float = 25.0  # per-rank bandwidth of the gradient reduction
    tp_gbs: float = 150.0  # bandwidth of the tensor-parallel collectives
    ep_gbs: float = 50.0  # bandwidth of the expert-parallel all-to-alls (cluster.ep_bandwidth_gbs)
    cp_gbs: float = 150.0  # bandwidth of the context-parallel K/V exchanges (cluster.cp_bandwidth_gbs)
    cp_rotate: str = "allgather"  # parallel.cp_rotate: how cp rows' attention reaches the other K/V
    fb_overlap: str = "off"  # pipeline.fb_overlap (auto: on CPU ranks; execution.overlaps decides per row)
    optim_gbs: float = 0.0  # memory bandwidth of the optimizer step (0: not timed)
    margin: float = 0.05  # fraction added for fragmentation and workspaces
    action_overhead_ms: float = 0.0  # added to every F, B, W and BW action (the executor's own time per action)
    layer_overhead_ms: float = 0.0  # added to every layer's F, B and W (the executor's own time per layer)
    reduce_latency_ms: float = 0.0  # added to every stage's data-parallel reduction
    step_overhead_ms: float = 0.0  # added once per step (loss, grad norm, optimizer launch)
    tp_latency_ms: float = 0.0  # added to every TP collective (schedules/tp_cost.py)
    lookahead: int = 1  # receives posted ahead (pipeline.p2p_lookahead)
    reduce_dtype: str = "float32"
    gpu_overhead_gb: float = 0.0  # per device outside the allocator: CUDA context, NCCL buffers (plan.gpu_overhead_gb)
    p2p_transport: str = "pair_groups"  # pipeline.p2p_transport: one_group refuses rows whose plan would hang on NCCL
    peak_tflops: float = 0.0  # what MFU divides by (plan.device's bf16 peak; local: plan.tflops)
    # plan.device: its links, by where each candidate's groups fall on nodes of `per_node` (planner/topology.py)
    spec: Optional[DeviceSpec] = None
    per_node: int = 0
    grad_overlap: float = 0.0  # share of a stage's last backward its dp reduction hides under (plan.grad_overlap)
