"""One rank's life: join the default process group, agree with rank 0, run the entry point.

Shared by every cluster option: the elastic workers of cluster=local and the processes
torchrun / srun / submitit started. A rank that fails writes its one-line message into
torchelastic's error file (TORCHELASTIC_ERROR_FILE, where the launcher set one), so the
launcher reports the rank that failed first instead of a wall of tracebacks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from pipetrain.config.parallel import world_text
from pipetrain.launch.devices import choose, gpu_index, ranks_sharing_gpus
from pipetrain.launch.env import RankEnv, torchrun_env
from pipetrain.launch.errors import record_error
from pipetrain.launch.forkserver import Inherit
from pipetrain.launch.rundir import record_rank

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.plan import Plan

Entry = Callable[["Config", "Plan", Path], dict]
STOPPED_EXIT = 143  # a worker's exit code after a stop on a signal: 128 + SIGTERM, as a shell reports it


def resolve_devices(config: Config, *, note: Optional[Callable[[str], None]] = None) -> Config:
    """config with trainer.device and cluster.backend decided for this host's GPUs (launch/devices.py:
    auto -> cpu / cuda, gloo / nccl). The launcher calls it before any rank starts and hands the
    result to the ranks; a rank calls it again, which keeps what is already decided."""
    devices = choose(config.trainer.device, config.cluster.backend, gpus=torch.cuda.device_count(),
                     local_ranks=ranks_sharing_gpus(config.cluster, config.layout.world, os.environ))
    if devices.note and note is not None:
        note(devices.note)
    if (devices.device, devices.backend) == (config.trainer.device, config.cluster.backend):
        return config
    resolved = copy.copy(config)  # the caller's config stays as composed
    resolved.trainer = dataclasses.replace(config.trainer, device=devices.device)
    resolved.cluster = dataclasses.replace(config.cluster, backend=devices.backend)
    return resolved


def run_rank(config: Config, plan: Plan, run_dir: Path, env: RankEnv, entry: Entry, *, agree: bool) -> dict:
    """Run `entry(config, plan, run_dir)` as rank env.rank of env.world_size.

    agree=True (ranks that composed their own config: torchrun, slurm, submitit): rank 0's config, plan
    and run directory are broadcast, so every rank cuts the model alike (partition=profile and
    schedule=auto measure on rank 0 only) and writes under one directory."""
    layout = config.layout
    world, what = layout.world, world_text(*layout.shape)
    owns_group = not dist.is_initialized()
    try:
        if env.world_size != world:
            fix = (f"set pipeline.degree={env.world_size}" if layout.world == layout.pp
                   else "change pipeline.degree, parallel.tp or the parallel.dp_* degrees "
                        "(parallel.dp_shard=-1 fills the world)")
            raise ValueError(
                f"{env.world_size} ranks were started but {what}: start {world} ranks "
                f"(e.g. torchrun --nproc_per_node={world}) or {fix}"
            )
        if not agree:  # the launcher holds the run directory's lock: this rank counts as part of its run
            record_rank(Path(run_dir), env.rank)
        config = resolve_devices(config, note=print if env.rank == 0 else None)
        backend = config.cluster.backend
        os.environ.update(env.exported())  # the trainer (and torch) read LOCAL_RANK, RANK, ...
        gpu = None
        if backend == "nccl":  # the one rule for this rank's GPU; the trainer reads it back (current_device)
            gpu = torch.device("cuda", gpu_index(env.local_rank, torch.cuda.device_count()))
            torch.cuda.set_device(gpu)
        if owns_group:
            timeout = datetime.timedelta(seconds=max(300.0, config.pipeline.p2p_timeout_s))
            store = _attempt_store(env, timeout)
            init = None if store else "env://" if env.use_env_store else f"tcp://{env.master_addr}:{env.master_port}"
            # device_id (NCCL): the communicator is created now, on this GPU, and new groups split from it
            dist.init_process_group(backend, init_method=init, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout, device_id=gpu)
        elif dist.get_world_size() != world:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but {what}")
        if agree:
            config, plan, run_dir = _agree_with_rank0(config, plan, Path(run_dir))
            with _rank0_lock(Path(run_dir)):
                record_rank(Path(run_dir), env.rank)
                return entry(config, plan, Path(run_dir))
        return entry(config, plan, Path(run_dir))
    except Exception as err:
        record_error(err)
        raise
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _agree_with_rank0(config: Config, plan: Plan, run_dir: Path) -> tuple[Config, Plan, Path]:
    """Rank 0's config, plan and run directory on every rank. The config too: under schedule=auto
    each rank chose a row on its own (only rank 0 measured, the others planned on analytic costs)."""
    mine = run_dir.resolve()
    objs: list[Any] = [config, plan, str(mine)]
    dist.broadcast_object_list(objs, src=0)
    shared = Path(objs[2])
    if shared != mine:  # Hydra gave this rank its own (timestamped) directory: leave it if unused
        try:
            mine.rmdir()
        except OSError:
            pass
    return objs[0], objs[1], shared


def _attempt_store(env: RankEnv, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """Under torch elastic's agent store (cluster=local, torchrun): the agent's TCPStore, with a
    prefix per attempt. The store outlives a restarted worker group, and without the prefix the
    new group's gloo would read the dead group's addresses and hang connecting to them."""
    if not (env.use_env_store and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    tcp = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"pipetrain/attempt_{attempt}", tcp)


@contextlib.contextmanager
def _rank0_lock(run_dir: Path) -> Iterator[None]:
    """Ranks started by torchrun / srun / submitit: rank 0 locks the run directory and every rank
    learns whether it could (a refusal is every rank's one-line error, not a hang)."""
    from pipetrain.launch.rundir import RunLock

    lock = RunLock(run_dir, note=print)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            lock.acquire()
        except ValueError as e:
            box[0] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])
    try:
        yield
    finally:
        lock.release()


def elastic_worker(entry: Entry, config: Config, plan: Plan, run_dir: str, inherit: Inherit) -> dict:
    """Entry point of cluster=local's workers: torch's elastic agent set the torchrun variables."""
    inherit.adopt()
    try:
        result = run_rank(config, plan, Path(run_dir), torchrun_env(), entry, agree=False)
    except Exception:
        # run_rank wrote the error file, with its time in ns. Leaving through SystemExit keeps the
        # @record that torch wraps around every elastic worker from overwriting it (whole seconds).
        raise SystemExit(1) from None
    if "stopped" in result:  # every rank's result says so (rank 0's holds the record)
        _leave_stopped()
    return result


def _leave_stopped() -> None:
    """The ranks stopped on a signal and saved (train/stop.py): leave now. A returning worker waits
    for the agent to read its return value, which an agent shutting down on that same signal never
    does (it would wait its 30 s and kill us). The launcher reads stopped.json instead; an agent
    that got no signal itself sees a non-zero exit, and launch_local still reports the stop."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOPPED_EXIT)
