"""Which device the ranks train on, which backend joins them, and which GPU is each rank's (no torch
where no GPU driver is present: visible_gpus imports torch only on a machine that may have a GPU).

One rule, applied before any rank starts (cluster=local: in the launcher, which knows how many ranks
this host runs) and again in each rank before its process group exists (torchrun, SLURM: every
process is a rank; on cluster=local the ranks get the launcher's answer, which the rule keeps):

  trainer.device=auto  CUDA when every rank of this host gets a GPU of its own, else the CPU (with one
                       note saying why, where GPUs are visible). An explicit cluster.backend decides
                       it: gloo -> CPU, nccl -> CUDA.
  cluster.backend=auto follows the device: NCCL on CUDA, gloo on the CPU.
  the GPU              local rank % visible GPUs: local rank i on GPU i where a rank sees all of the
                       host's GPUs; GPU 0 where SLURM gives each task its own (--gpus-per-task=1).

Refused (ValueError, one line): trainer.device=cuda where no GPU is visible or where this host runs
more ranks than it shows GPUs (NCCL allows one rank per GPU); NCCL with the CPU and gloo with CUDA
(config/cluster.py: check_backend, when the config is composed).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from pipetrain.config.cluster import ClusterConfig, check_backend

if TYPE_CHECKING:
    from pipetrain.config import Config

# What a machine where CUDA (or ROCm) could see a GPU has: without any of these, no GPU is visible
# and torch need not be imported to count them.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/gpus", "/dev/kfd")


@dataclass(frozen=True)
class Devices:
    device: str  # cpu | cuda: what trainer.device means for this run
    backend: str  # gloo | nccl: what cluster.backend means for this run
    note: Optional[str] = None  # why trainer.device=auto chose the CPU on a machine with GPUs


def choose(device: str, backend: str, *, gpus: int, local_ranks: Optional[int]) -> Devices:
    """trainer.device and cluster.backend (each possibly auto) for `gpus` visible GPUs and
    `local_ranks` ranks on this host that see the same GPUs (None: SLURM, where each task may
    see only its own GPUs, so any number of ranks is fine)."""
    check_backend(backend, device)
    note = None
    if device == "auto":
        fits = gpus > 0 and (local_ranks is None or local_ranks <= gpus)
        device = {"gloo": "cpu", "nccl": "cuda"}.get(backend, "cuda" if fits else "cpu")
        if device == "cpu" and backend == "auto" and gpus > 0:
            note = (f"trainer.device=auto: {local_ranks} ranks on this host but {_gpus(gpus)}, so they train on "
                    f"the CPU (gloo); to train on GPUs set trainer.device=cuda with at most one rank per GPU")
    if device == "cuda":
        if gpus == 0:
            knob = "cluster.backend=nccl" if backend == "nccl" else "trainer.device=cuda"
            raise ValueError(f"{knob} needs a CUDA GPU and none is visible: set trainer.device=cpu "
                             f"(or auto) and cluster.backend=auto")
        if local_ranks is not None and local_ranks > gpus:
            raise ValueError(
                f"{local_ranks} ranks on this host but {_gpus(gpus)} (NCCL needs one GPU per rank): run at most "
                f"{gpus} ranks per host (pipeline.degree, parallel.*, cluster.ranks_per_node) "
                f"or set trainer.device=cpu")
    return Devices(device, "nccl" if device == "cuda" else "gloo", note)


def gpu_index(local_rank: int, gpus: int) -> int:
    """The visible GPU of this rank: local rank i on GPU i when it sees the whole host's GPUs
    (choose() checked there are enough), and GPU 0 when SLURM shows each task only its own."""
    if gpus < 1:
        raise ValueError("no CUDA GPU is visible: set trainer.device=cpu")
    return local_rank % gpus


def ranks_sharing_gpus(cluster: ClusterConfig, world: int, environ: Mapping[str, str]) -> Optional[int]:
    """How many ranks of this host see the same GPUs (each needs its own), or None where that
    cannot be told: SLURM may bind each task to its own GPUs (--gpus-per-task, --gpu-bind)."""
    if cluster.name == "local":  # this host runs the whole world
        return world
    if cluster.name == "torchrun":  # torchrun's workers all see the node's GPUs
        return int(environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in environ else None
    if cluster.name == "submitit_local":  # one CUDA_VISIBLE_DEVICES for all tasks of the job
        return cluster.tasks_per_node(world)
    return None


def _gpus(n: int) -> str:
    return f"{n} visible GPU" + ("" if n == 1 else "s")


def visible_gpus(environ: Mapping[str, str] = os.environ) -> int:
    """How many GPUs torch would see. Without torch where it cannot be more than 0: CUDA_VISIBLE_DEVICES
    empty (or -1), or no GPU driver on the machine (GPU_DRIVER_FILES); else (and in a process that has
    torch already) torch.cuda.device_count(): the one place the launcher may import torch before ranks."""
    hidden = environ.get("CUDA_VISIBLE_DEVICES")
    if "torch" not in sys.modules:
        if hidden is not None and hidden.strip() in ("", "-1"):
            return 0
        if not any(Path(f).exists() for f in GPU_DRIVER_FILES):
            return 0
    import torch

    return torch.cuda.device_count()


def resolve_devices(config: Config, *, note: Optional[Callable[[str], None]] = None) -> Config:
    """config with trainer.device and cluster.backend decided for this host's GPUs (choose(): auto ->
    cpu / cuda, gloo / nccl). The launcher calls it before any rank starts and hands the result to the
    ranks; a rank calls it again, which keeps what is already decided."""
    devices = choose(config.trainer.device, config.cluster.backend, gpus=visible_gpus(),
                     local_ranks=ranks_sharing_gpus(config.cluster, config.layout.world, os.environ))
    if devices.note and note is not None:
        note(devices.note)
    if (devices.device, devices.backend) == (config.trainer.device, config.cluster.backend):
        return config
    resolved = copy.copy(config)  # the caller's config stays as composed
    resolved.trainer = dataclasses.replace(config.trainer, device=devices.device)
    resolved.cluster = dataclasses.replace(config.cluster, backend=devices.backend)
    return resolved
