"""What `plan.device` changes in a plan (planner/cmd.py asks here): the layers' timing on the device
(planner/compute.py), its links (planner/topology.py, read per candidate by planner/search.py), the tp degrees
searched, bf16, FLOP counts for MFU, and the field's default for a model whose weights and optimizer state do
not fit one device: FSDP2 (dp_shard) rows first, replicated rows only where they fit. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from pipetrain.config import Config
from pipetrain.config.devices import LOCAL, device_spec
from pipetrain.partition.costs import LayerCost
from pipetrain.planner.compute import Timing
from pipetrain.planner.memory import GB, StateBytes

NODE_TP = (1, 2, 4, 8)  # tp degrees a device plan tries by default: powers of two inside one node


def on_device(config: Config) -> bool:
    return config.plan.device != LOCAL


def timing(config: Config) -> Optional[Timing]:
    """How layers are timed on plan.device (None: local, FLOPs at plan.tflops or measured here)."""
    p = config.plan
    if not on_device(config):
        return None
    return Timing(device_spec(p.device), attention=p.attention, fp8=p.fp8, value_bytes=2, fused=p.fused_elementwise)


def planned_config(config: Config) -> Config:
    """The config a device plan costs: bf16 (GPU training's precision; trainer.precision=fp32 is a CPU run's)."""
    if not on_device(config) or config.trainer.precision == "bf16":
        return config
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, precision="bf16"))


def tp_degrees(config: Config) -> list[int]:
    """plan.tp, its null resolved: [1] locally; on a device every power of two up to its node that divides what
    the model splits (heads, widths, vocabulary)."""
    p, m = config.plan, config.model
    if p.tp is not None:
        return list(p.tp)
    if not on_device(config):
        return [1]
    divides = m.tp_divides() or {}
    return [t for t in NODE_TP if t <= (p.node_size or 1) and (t == 1 or divides)
            and all(v % t == 0 for v in divides.values())]


def device_fields(config: Config) -> dict:
    """planner/workload.py Device's plan.device fields: the spec, the node size, MFU's peak, grad_overlap."""
    p = config.plan
    if not on_device(config):
        return {"peak_tflops": p.tflops or config.sim.tflops, "grad_overlap": p.grad_overlap, "optim_gbs": p.optim_gbs}
    spec = device_spec(p.device)
    # AdamW's step reads a parameter's 16 bytes of state and writes 12 back: 28 bytes per 16 held, at 80% of HBM
    optim = p.optim_gbs or spec.memory_tbs * 1e3 * 0.8 * 16 / 28
    return {"spec": spec, "per_node": p.node_size, "peak_tflops": spec.bf16_tflops, "grad_overlap": p.grad_overlap,
            "optim_gbs": optim}


def flop_counts(layers: Sequence[LayerCost]) -> tuple[float, float]:
    """(model FLOPs per token as MFU counts them: 3 x every layer's forward, i.e. 6 x parameters + attention;
    what a full recompute adds: the blocks' forward again, as Megatron-LM's count has it) from unsplit layers."""
    forward = math.fsum(layer.flops_per_token for layer in layers)
    blocks = math.fsum(layer.flops_per_token for layer in layers if layer.name not in ("embed", "head"))
    return 3.0 * forward, blocks


def shard_first(config: Config, params: float, state: StateBytes) -> Optional[str]:
    """Where plan.device is set, plan.dp_shard null and the model's weights, gradients and AdamW state do not fit
    one device: the note saying FSDP2 rows come first (None: replicas as configured)."""
    p = config.plan
    if p.dp_shard is not None or not on_device(config):  # a local plan keeps its replicas (plan.dp_shard=true shards)
        return None
    held = params * state.total
    if held <= p.memory_budget_gb * GB:
        return None
    return (f"plan: {config.model.name}'s weights and AdamW state ({held / GB:.0f} GB) do not fit one "
            f"{p.memory_budget_gb:g} GB device replicated: FSDP2 (dp_shard) rows first, replicated rows only where "
            f"they fit (plan.dp_shard=true or false to choose)")


def describe(config: Config) -> str:
    """The layer times' source on plan.device, for the plan's first line."""
    t = timing(config)
    assert t is not None
    fp8 = f", linear GEMMs fp8 ({t.device.fp8_tflops:g} peak)" if t.fp8 else ""
    return (f"{t.device.name} GEMMs by shape ({t.device.bf16_tflops:g} TFLOP/s bf16 peak, {t.kernels.gemm:.0%} "
            f"at large sizes), {t.attention} attention, element-wise by bytes at {t.device.memory_tbs:g} TB/s{fp8}")


def links_text(config: Config) -> str:
    """plan.device's links, for the plan's first line."""
    from pipetrain.planner.topology import NETWORK_SHARE, NVLINK_SHARE

    spec, per_node = device_spec(config.plan.device), config.plan.node_size
    return (f"{per_node} per node, {spec.link_gbs * NVLINK_SHARE:g} GB/s inside (NVLink/xGMI), "
            f"{spec.network_gbs / per_node * NETWORK_SHARE:g} GB/s per device across; tp fastest, then cp, dp, pp")
