"""`launch(config, plan, run_dir)`: run the training entry point on every pipeline rank.

cluster=local starts the ranks (launch/agent.py: no torch in this process); cluster=slurm outside a
SLURM job submits the run's sbatch script and returns (launch/submit.py); every other case runs in a process that is
already one rank (started by torchrun, srun or submitit) and only joins the group.
Importing this module loads no torch; each path imports what it needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from pipetrain.config.parallel import world_text
from pipetrain.launch import env as rank_env
from pipetrain.launch.errors import RunStopped
from pipetrain.launch.parent import STARTED_UNDER, die_with_parent  # imported early: STARTED_UNDER

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.plan import Plan

Entry = Union[Callable[["Config", "Plan", Path], dict], str]  # a function, or "module:function"


def launch(config: Config, plan: Plan, run_dir: Path, *, entry: Optional[Entry] = None) -> dict:
    """Run `entry(config, plan, run_dir)` (default: the trainer's rank_main) on the world's
    ranks (pipeline.degree x parallel.dp_replicate x parallel.dp_shard) as config.cluster says;
    return rank 0's result ({} on the other ranks of an already-launched job). A failed rank raises
    RankFailedError (launch/errors.py) with that rank's one-line message. cluster=slurm outside a
    SLURM job submits instead: its job reruns the pipetrain command (whose mode picks the entry) and
    this returns {"submitted": job id}."""
    cluster = config.cluster
    layout = config.layout
    cluster.check_world(layout.world, world_text(*layout.shape))
    if cluster.name == "slurm" and not rank_env.in_slurm_job():  # a login node: its devices do not count
        from pipetrain.launch.submit import submit

        return submit(config, Path(run_dir))
    from pipetrain.launch.devices import resolve_devices
    from pipetrain.launch.resolvers import process_rank

    entry = entry or "pipetrain.train.trainer:rank_main"  # by name: the ranks import it, this process need not

    # trainer.device / cluster.backend auto decided once, here, before the ranks start (launch/devices.py)
    config = resolve_devices(config, note=print if process_rank(cluster.name) == 0 else None)
    run_dir = Path(run_dir).resolve()
    if cluster.name == "local":
        from pipetrain.launch.agent import launch_local
        from pipetrain.launch.rundir import RunLock

        with RunLock(run_dir, note=print):  # held by this process across the workers' restarts
            return _finished(launch_local(config, plan, run_dir, entry))

    from pipetrain.launch.rank import run_rank  # this process is a rank: torch from here on

    if cluster.name == "torchrun":
        env = rank_env.torchrun_env()
        die_with_parent(STARTED_UNDER)  # the agent starts each rank in a session of its own
    elif cluster.name == "slurm":
        env = rank_env.slurm_env(cluster.master_port)
    elif cluster.name == "submitit_local":
        env = rank_env.submitit_local_env(cluster.master_port)
    else:  # ClusterConfig.__post_init__ admits only the names above
        raise AssertionError(cluster.name)
    return _finished(run_rank(config, plan, run_dir, env, entry, agree=True))


def prestart(config: Config) -> None:
    """cluster=local on CPU: start the server the ranks fork from now (launch/forkserver.py), before
    this process imports torch, so that its imports overlap our checks and simulation. Unless the
    config says NCCL or CUDA; with both on auto a machine with a GPU for each rank starts one it
    will not use (launch() decides the device after this, launch/devices.py)."""
    if config.cluster.name == "local" and config.cluster.backend != "nccl" and config.trainer.device != "cuda":
        from pipetrain.launch.forkserver import warm

        warm("gloo", compile=config.trainer.compile)


def _finished(result: dict) -> dict:
    """Rank 0's result, or RunStopped when the ranks stopped on a signal (train/stop.py)."""
    if result.get("stopped"):
        raise RunStopped(result["stopped"])
    return result
