"""The device a rank computes on, and the torch settings that go with it, set once per rank."""

from __future__ import annotations

import torch

from pipetrain.config.train import TrainerConfig


def resolve_device(choice: str) -> torch.device:
    """trainer.device as the launcher decided it (launch/devices.py): on CUDA, the GPU run_rank made
    current (local rank % visible GPUs), so one rule picks it. auto here (a Trainer built outside
    the launcher) follows the same rule for a single rank."""
    if choice == "auto":
        from pipetrain.launch.devices import choose

        choice = choose("auto", "auto", gpus=torch.cuda.device_count(), local_ranks=1).device
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible: use trainer.device=cpu or auto")
    return torch.device("cuda", torch.cuda.current_device())


def set_up_device(cfg: TrainerConfig) -> torch.device:
    """This rank's device, with its host threads (trainer.threads_per_rank: on CUDA too, the host work
    of 8 ranks per node, each using every core, would oversubscribe the node) and, on CUDA, fp32
    matmuls on TF32 tensor cores or exact (trainer.tf32)."""
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads_per_rank)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")
    return device
