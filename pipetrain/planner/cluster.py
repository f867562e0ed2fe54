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
from pipetrain.config.data import DataConfig
from pipetrain.config.devices import LOCAL, device_spec
from pipetrain.partition.costs import LayerCost
from pipetrain.planner.compute import Timing
from pipetrain.planner.degrees import world_size
from pipetrain.planner.memory import GB, StateBytes

def on_device(config: Config) -> bool:
    return config.plan.device != LOCAL


def timing(config: Config) -> Optional[Timing]:
    """How layers are timed on plan.device (None: local, FLOPs at plan.tflops or measured here)."""
    p = config.plan
    if not on_device(config):
        return None
    return Timing(device_spec(p.device), attention=p.attention, fp8=p.fp8, value_bytes=2, fused=p.fused_elementwise)


PRETRAIN_SEQ, PER_DEVICE = 8192, 2  # a device plan's sequence and sequences per device where the config gives none


def planned_config(config: Config) -> Config:
    """The config a device plan costs: bf16 (GPU training's precision; trainer.precision=fp32 is a CPU run's); where
    data.seq_len is still the CPU quickstart's default, the model's pretraining length (min(8192, its longest)), and
    where plan.global_batch and data.batch_size are both defaults, 2 sequences per device (torchtitan's local batch
    for Llama 3.1 8B); plan.recompute's default [false] searched as [false, true]. `planned_note` says which of the
    sequence and batch it chose."""
    if not on_device(config):
        return config
    d, p, m = config.data, config.plan, config.model
    data = d
    if m.has_seq and d.seq_len == DataConfig.seq_len:
        data = dataclasses.replace(data, seq_len=min(PRETRAIN_SEQ, getattr(m, m.seq_knob)))
    plan = p
    if p.global_batch is None and d.batch_size == DataConfig.batch_size:
        plan = dataclasses.replace(p, global_batch=PER_DEVICE * world_size(config))
    if p.recompute == [False]:  # the default's: a cluster's long sequences are planned with recompute too
        plan = dataclasses.replace(plan, recompute=[False, True])
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, precision="bf16"), data=data,
                               plan=plan)


def planned_note(config: Config, planned: Config) -> Optional[str]:
    """One line where planned_config chose the sequence or the batch (None where the config gave both)."""
    chose = []
    if planned.data.seq_len != config.data.seq_len:
        chose.append(f"data.seq_len={planned.data.seq_len} (the {config.data.seq_len} of a CPU quickstart is not a "
                     f"cluster's)")
    if planned.plan.global_batch != config.plan.global_batch:
        chose.append(f"plan.global_batch={planned.plan.global_batch} ({PER_DEVICE} sequences per device)")
    return f"plan: planned at {' and '.join(chose)}: set them to plan your run's" if chose else None


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
