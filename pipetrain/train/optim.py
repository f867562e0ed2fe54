"""AdamW with decay / no-decay groups, warm-up + cosine learning rate, global grad clipping."""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.compat import AdamW, foreach_mul_
from pipetrain.config.train import OptimConfig
from pipetrain.runtime.sync import local_tensor


def make_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig, *, device: torch.device) -> torch.optim.AdamW:
    """Matrices (>= 2-D: linear and embedding weights) decay; biases and norm gains do not (GPT-2/nanoGPT).
    torch's AdamW, built and stepped without importing torch._dynamo where nothing compiles (compat.AdamW)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=device.type == "cuda" or None
    )


def lr_at(step: int, cfg: OptimConfig, decay_steps: int) -> float:
    """Linear warm-up over warmup_steps, then cosine decay from lr to min_lr at step decay_steps
    (optim.decay_steps, else the run's trainer.max_steps as it was started), then min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, decay_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def global_grad_norm(owned: Iterable[nn.Parameter], *, group: Optional[dist.ProcessGroup] = None,
                     device: torch.device) -> float:
    """L2 norm of the whole model's gradient: each rank takes the norm of the parameters it
    owns with torch's foreach kernels (every tied or mirrored weight is owned by exactly one
    rank of a pipeline; FSDP2 shards: the local part), squares it in fp64, then one
    all-reduce sums the squares (data parallel: the caller passes no parameters on every
    replica but one)."""
    grads = [local_tensor(p.grad).detach() for p in owned if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
    total = local.to(device=device, dtype=torch.float64).square()
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    return math.sqrt(total.item())


def clip_grads(params: Iterable[nn.Parameter], norm: float, max_norm: float) -> None:
    """Scale every local gradient (all copies alike, so copies stay identical) to max_norm,
    with one foreach multiply (FSDP2 DTensor grads: their local shards, in place)."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if grads:
        with torch.no_grad():
            foreach_mul_(grads, max_norm / (norm + 1e-6))
