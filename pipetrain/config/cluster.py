"""Schema of the `cluster` config group: where the ranks run (pure: no torch).

  local           one process per rank on this host, started and watched by the `pipetrain` process
                  itself as torchrun would start them (launch/agent.py; it imports no torch).
  torchrun        this process is already one rank, started by `torchrun` (RANK, WORLD_SIZE, ...).
  slurm           one SLURM task per rank, started by srun (`srun pipetrain cluster=slurm ...`, the
                  sbatch template launch/templates/pipetrain.sbatch); from a login node the same
                  command submits that script, prints the job id and returns (launch/submit.py).
  submitit_local  one submitit task per rank, through hydra-submitit-launcher's local executor
                  (`pipetrain -m cluster=submitit_local ...`; no cluster needed; it waits for the jobs).

The OmegaConf resolvers the cluster configs use (`${pipetrain.on_rank0:...}`, ...) are in
pipetrain/launch/resolvers.py, registered by whoever composes a config (the CLI, the sbatch renderer, the tests),
not by importing this schema.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Optional

CLUSTERS = ("local", "torchrun", "slurm", "submitit_local")
BACKENDS = ("auto", "gloo", "nccl")  # auto: nccl when the ranks train on CUDA, else gloo (launch/devices.py)

# Knobs that only some clusters read: setting one elsewhere would silently do nothing.
_READ_BY: dict[str, tuple[str, ...]] = {
    "nodes": ("slurm",),
    "ranks_per_node": ("slurm", "submitit_local"),
    "gpus_per_node": ("slurm", "submitit_local"),
    "cpus_per_task": ("slurm", "submitit_local"),
    "partition": ("slurm",),
    "account": ("slurm",),
    "qos": ("slurm",),
    "time_min": ("slurm", "submitit_local"),
    "mem_gb": ("slurm",),
    "setup": ("slurm",),  # hydra-submitit-launcher's local queue has no setup lines
    "wait": ("slurm",),  # submitit_local waits, always: its jobs are this machine's processes
    "master_port": ("local", "slurm", "submitit_local"),  # torchrun: its own MASTER_PORT
}


@dataclass
class ClusterConfig:
    name: str = "local"  # local | torchrun | slurm | submitit_local (see the module docstring)
    nodes: int = 1  # slurm: hosts in the job
    ranks_per_node: Optional[int] = None  # SLURM tasks per node; None: pipeline.degree / nodes
    gpus_per_node: Optional[int] = None  # GPUs to reserve per node; None: none (CPU ranks)
    cpus_per_task: Optional[int] = None  # CPU cores per rank; None: the scheduler's default
    partition: Optional[str] = None  # slurm partition (sbatch --partition)
    account: Optional[str] = None  # slurm account to charge (sbatch --account)
    qos: Optional[str] = None  # slurm quality of service (sbatch --qos)
    time_min: int = 60  # wall-clock limit of the job in minutes (sbatch --time)
    mem_gb: Optional[int] = None  # memory per node in GB; None: the partition's default
    setup: list[str] = field(default_factory=list)  # shell lines run before the ranks start (module load, ...)
    # slurm, from a login node: keep the command until the submitted job ends (sbatch --wait; a
    # sweep's jobs then run one after another) instead of returning once it is queued (launch/submit.py)
    wait: bool = False
    master_port: Optional[int] = None  # rendezvous port; None: a free one (local) or one derived from the job id
    backend: str = "auto"  # auto | gloo | nccl
    # GB/s (1e9 bytes) one rank reaches in a data-parallel collective: what the simulator divides
    # a stage's gradient bytes by (every cluster option reads it). 50: about a 400 Gb/s NIC per
    # GPU; NVLink within a node reaches more, gloo over loopback far less (bench/data_parallel_reduce.py).
    dp_bandwidth_gbs: float = 50.0
    # GB/s one rank reaches in a tensor-parallel collective (its tp group sits inside a node):
    # the simulator adds each layer's TP all-reduces / all-gathers at this rate. 150: the bus
    # bandwidth NCCL's all-reduce reaches over NVLink on A100-class nodes.
    tp_bandwidth_gbs: float = 150.0
    # GB/s one rank reaches in an expert-parallel all-to-all (dispatch and combine of every MoE layer):
    # the simulator adds each MoE layer's all-to-all bytes at this rate (partition/costs.py a2a_bytes). 50: about
    # a 400 Gb/s InfiniBand NIC per GPU, DeepSeek-V3's cross-node EP link (arXiv 2412.19437 sec. 3.2.2:
    # IB 50 GB/s, NVLink 160 GB/s); an EP group inside one NVLink node reaches about 3x more.
    ep_bandwidth_gbs: float = 50.0
    # GB/s one rank reaches in a context-parallel K/V all-gather or ring step: the cp group sits next to
    # tp on the mesh (parallel/layout.py), inside a node while cp x tp <= its GPUs, so tp's 150 (NVLink).
    cp_bandwidth_gbs: float = 150.0

    def __post_init__(self) -> None:
        if self.name not in CLUSTERS:
            raise ValueError(f"cluster={self.name!r} is unknown: choose cluster= one of {', '.join(CLUSTERS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"cluster.backend={self.backend!r} is unknown: choose one of {', '.join(BACKENDS)}")
        for knob in ("nodes", "ranks_per_node", "cpus_per_task", "time_min", "mem_gb"):
            value = getattr(self, knob)
            if value is not None and value < 1:
                raise ValueError(f"cluster.{knob} must be >= 1 (got {value})")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"cluster.gpus_per_node must be >= 0 (got {self.gpus_per_node})")
        for knob, what in (("dp", "data-parallel collectives"), ("tp", "tensor-parallel collectives"),
                           ("ep", "expert-parallel all-to-alls"), ("cp", "context-parallel K/V exchanges")):
            value = getattr(self, f"{knob}_bandwidth_gbs")
            if not value > 0:
                raise ValueError(f"cluster.{knob}_bandwidth_gbs must be > 0 GB/s (got {value}): "
                                 f"the bandwidth one rank reaches in {what}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ValueError(f"cluster.master_port must be a port in 1..65535 (got {self.master_port})")
        self._check_knobs_are_read()

    def _check_knobs_are_read(self) -> None:
        """A knob this cluster option ignores, set away from its default, is a mistake worth a message."""
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            readers = _READ_BY.get(f.name)
            if readers and self.name not in readers and getattr(self, f.name) != default:
                raise ValueError(
                    f"cluster.{f.name} is read only by cluster={' or '.join(readers)} (got cluster={self.name}): "
                    f"drop cluster.{f.name} or choose one of those clusters"
                )

    def tasks_per_node(self, world: int, what: str = "") -> int:
        """SLURM tasks (= ranks) per node; raises if the ranks do not fill the nodes evenly."""
        return tasks_per_node(world, self.nodes, self.ranks_per_node, what)

    def check_world(self, world: int, what: str = "") -> None:
        """Cross-check with the world size: one SLURM task per rank, filling the nodes evenly."""
        if self.name in ("slurm", "submitit_local"):
            self.tasks_per_node(world, what)

    def check_device(self, device: str) -> None:
        """Cross-check with trainer.device (check_backend)."""
        check_backend(self.backend, device)

    def fixed_world(self) -> Optional[int]:
        """The world size this cluster option fixes before pipetrain decides (None: pipetrain decides)."""
        if self.name in ("slurm", "submitit_local") and self.ranks_per_node is not None:
            return self.nodes * self.ranks_per_node
        return None


def check_backend(backend: str, device: str) -> None:
    """cluster.backend against trainer.device, before any rank starts: NCCL carries CUDA tensors only,
    and gloo's send / recv (the pipeline's P2P) CPU tensors only (torch's backend table)."""
    if backend == "nccl" and device == "cpu":
        raise ValueError("cluster.backend=nccl carries CUDA tensors but trainer.device=cpu: set "
                         "trainer.device=cuda (or auto), or cluster.backend=gloo (or auto)")
    if backend == "gloo" and device == "cuda":
        raise ValueError("cluster.backend=gloo cannot send CUDA tensors between ranks (trainer.device=cuda): set "
                         "cluster.backend=nccl (or auto), or trainer.device=cpu")


ONE_QUEUE = ("pipeline.fb_overlap=on needs the all-to-alls' stream beside the compute stream, which "
             "CUDA_DEVICE_MAX_CONNECTIONS=1 puts in one hardware queue: unset it (or set it to 8 or more), or set "
             "pipeline.fb_overlap=auto or off")


def one_hw_queue(device: str) -> bool:
    """Whether a GPU run's streams share one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron's setting
    for tensor-parallel overlap): then a kernel on one stream waits for those queued before it on any other,
    and F&B overlap's all-to-alls would wait for the compute they are meant to hide under (`ONE_QUEUE`).
    `device`: trainer.device (auto may be a GPU); the ranks inherit the launcher's environment."""
    return device != "cpu" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"


def tasks_per_node(world: int, nodes: int, ranks_per_node: Optional[int], what: str = "") -> int:
    what = what or f"pipeline.degree={world}"
    if ranks_per_node is None:
        if world % nodes:
            raise ValueError(
                f"{what} ranks do not split evenly over cluster.nodes={nodes}: "
                f"set cluster.nodes to a divisor of {world}"
            )
        return world // nodes
    if nodes * ranks_per_node != world:
        raise ValueError(
            f"cluster.nodes={nodes} x cluster.ranks_per_node={ranks_per_node} = {nodes * ranks_per_node} tasks, "
            f"but {what} ranks: make nodes x ranks_per_node equal {world}"
        )
    return ranks_per_node
