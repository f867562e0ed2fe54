"""Who am I? A rank's place in the job, read from the environment its launcher set (no torch).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; srun sets SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID / SLURM_JOB_NODELIST; submitit's local executor sets its own
variables, read through `submitit.JobEnvironment()`. Each becomes one `RankEnv`.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional

# Ports derived from a job id land here: above the usual service ports, below the kernel's
# ephemeral range (32768+ on Linux), so a rank's own outgoing connections cannot hold it.
PORT_BASE, PORT_SPAN = 20000, 12000
# Set by cluster=local's launcher (launch/agent.py) beside the torchrun variables: where rank 0
# publishes the port of the rendezvous store it hosts (launch/rank.py), and where it keeps the step in
# progress for a restarted attempt to read (train/restart.py).
STORE_FILE = "PIPETRAIN_STORE_FILE"
STEP_FILE = "PIPETRAIN_STEP_FILE"


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    use_env_store: bool = False  # torchrun: init through env:// so the agent's store is used

    def exported(self) -> dict[str, str]:
        """The torchrun-style variables, for code that reads them (the trainer reads LOCAL_RANK)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def _need(env: Mapping[str, str], names: tuple[str, ...], hint: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: {hint}")


def torchrun_env(env: Mapping[str, str] = os.environ) -> RankEnv:
    _need(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
          "cluster=torchrun runs under torchrun (torchrun --nproc_per_node=P -m pipetrain.cli cluster=torchrun ...); "
          "to start the ranks from here use cluster=local")
    return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), env["MASTER_ADDR"],
                   int(env["MASTER_PORT"]), use_env_store=True)


def slurm_requeues(env: Mapping[str, str] = os.environ) -> int:
    """How many times SLURM requeued this job (a preempted or timed-out job that submitit requeued)."""
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)


def in_slurm_job(env: Mapping[str, str] = os.environ) -> bool:
    """Inside a SLURM allocation (sbatch, salloc, srun set SLURM_JOB_ID); a login node is not."""
    return bool(env.get("SLURM_JOB_ID"))


def slurm_env(master_port: Optional[int] = None, env: Mapping[str, str] = os.environ) -> RankEnv:
    """One SLURM task = one rank; rank 0 (task 0) runs on the first host of the job's node list
    (or on MASTER_ADDR where the user set it)."""
    env = dict(env)
    env.setdefault("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
    _need({k: v for k, v in env.items() if v}, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST",
                                                "SLURM_JOB_ID"),
          "cluster=slurm runs as SLURM tasks: start it with `srun pipetrain cluster=slurm ...` inside an "
          "allocation (from a login node, `pipetrain cluster=slurm ...` submits it)")
    addr = env.get("MASTER_ADDR") or first_host(env["SLURM_JOB_NODELIST"])
    port = master_port or derived_port(env["SLURM_JOB_ID"])
    return RankEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"]), addr, port)


def submitit_local_env(master_port: Optional[int] = None) -> RankEnv:
    import submitit

    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        raise ValueError("cluster=submitit_local runs as submitit tasks: start it with "
                         "`pipetrain -m cluster=submitit_local ...` (Hydra launchers act in multirun mode)")
    job = submitit.JobEnvironment()
    return RankEnv(job.global_rank, job.num_tasks, job.local_rank, "127.0.0.1",
                   master_port or derived_port(job.job_id))


def derived_port(job_id: str) -> int:
    """A port every task of one job computes alike and concurrent jobs (a sweep) rarely share."""
    return PORT_BASE + zlib.crc32(str(job_id).encode()) % PORT_SPAN


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list, without scontrol: 'gpu[003-004,7],cpu1' -> 'gpu003',
    'a-[1-2]-b[5,6]' -> 'a-1-b5', 'node7' -> 'node7' (zero padding kept, as SLURM writes it)."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first host group ends at a comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    group = nodelist[:end].strip()
    # each bracket holds ranges 'a-b' and single ids separated by commas: the first id comes first
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], group)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}: set MASTER_ADDR")
    return host
