"""One rank's life: join the default process group, agree with rank 0, run the entry point.

Shared by every cluster option: the ranks of cluster=local (launch/agent.py) and the processes
torchrun / srun / submitit started. A rank that fails writes its one-line message into
torchelastic's error file (TORCHELASTIC_ERROR_FILE, where the launcher set one), so the
launcher reports the rank that failed first instead of a wall of tracebacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import os
import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from pipetrain.config.parallel import world_text
from pipetrain.launch.devices import gpu_index, resolve_devices
from pipetrain.launch.env import STORE_FILE, RankEnv, torchrun_env
from pipetrain.launch.errors import STOPPED_EXIT, record_error
from pipetrain.launch.forkserver import Inherit
from pipetrain.launch.rundir import record_rank

if TYPE_CHECKING:
    from pipetrain.config import Config
    from pipetrain.plan import Plan

Entry = Union[Callable[["Config", "Plan", Path], dict], str]  # a function, or "module:function"


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
        timeout = datetime.timedelta(seconds=max(300.0, config.pipeline.p2p_timeout_s))
        store = _attempt_store(env, timeout) if owns_group else None
        if store is not None and env.master_port == 0:  # rank 0 bound a free port: the one every rank uses
            env = dataclasses.replace(env, master_port=store.port)
        os.environ.update(env.exported())  # the trainer (and torch) read LOCAL_RANK, RANK, ...
        gpu = None
        if backend == "nccl":  # the one rule for this rank's GPU; the trainer reads it back (current_device)
            gpu = torch.device("cuda", gpu_index(env.local_rank, torch.cuda.device_count()))
            torch.cuda.set_device(gpu)
        if owns_group:
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
                return _function(entry)(config, plan, Path(run_dir))
        result = _function(entry)(config, plan, Path(run_dir))
        if store is not None and os.environ.get(STORE_FILE):
            _leave_together(store, env)
        return result
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
    """The rendezvous store where a launcher left it to the ranks (None: init_process_group's env://
    or tcp:// finds it). cluster=local (launch/agent.py): rank 0 hosts it on a port the kernel picks
    (MASTER_PORT=0) or on cluster.master_port, and publishes the port in the attempt's STORE_FILE,
    which the others read; each attempt has its own. Under torch elastic's agent (torchrun): the
    agent's TCPStore, with a prefix per attempt: the store outlives a restarted worker group, and
    without the prefix the new group's gloo would read the dead group's addresses and hang."""
    published = os.environ.get(STORE_FILE)
    if published:
        if env.rank == 0:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=True,
                                  wait_for_workers=False, timeout=timeout)
            partial = f"{published}.partial"
            Path(partial).write_text(str(store.port))
            os.replace(partial, published)
            return store
        deadline = time.monotonic() + timeout.total_seconds()
        while not os.path.exists(published):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not start the rendezvous store within {timeout.total_seconds():g}s")
            time.sleep(0.005)
        port = int(Path(published).read_text())
        return dist.TCPStore(env.master_addr, port, env.world_size, is_master=False, timeout=timeout)
    if not (env.use_env_store and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    tcp = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"pipetrain/attempt_{attempt}", tcp)


def _leave_together(store: dist.Store, env: RankEnv) -> None:
    """Rank 0 hosts the rendezvous store (STORE_FILE): it leaves only once every rank has said it is done,
    so that none is still talking to the store (still connecting, say, when rank 0's entry returned at
    once) when it goes away with rank 0's process."""
    left = store.add(_LEFT, 1)
    if env.rank != 0:
        return
    deadline = time.monotonic() + 60.0
    while left < env.world_size and time.monotonic() < deadline:
        time.sleep(0.005)
        left = store.add(_LEFT, 0)


_LEFT = "pipetrain/ranks_done"


def _function(entry: Entry) -> Callable[..., dict]:
    """An entry point given by name ("module:function", so that the launcher need not import it) or as is."""
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        return getattr(importlib.import_module(module), name)
    return entry


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


def local_worker(entry: Entry, config: Config, plan: Plan, run_dir: str, inherit: Inherit,
                 variables: dict[str, str], result_file: Optional[str]) -> None:
    """A rank of cluster=local (launch/agent.py): the torchrun variables its launcher set, then run_rank;
    rank 0 leaves its result in `result_file` for the launcher."""
    inherit.adopt()
    os.environ.update(variables)
    try:
        result = run_rank(config, plan, Path(run_dir), torchrun_env(), entry, agree=False)
    except Exception:
        # run_rank wrote the error file, with its time in ns: leave with exit code 1, quietly
        raise SystemExit(1) from None
    if result_file is not None:
        partial = f"{result_file}.partial"
        with open(partial, "wb") as f:
            pickle.dump(result, f)
        os.replace(partial, result_file)
    if "stopped" in result:  # every rank's result says so (rank 0's holds the record)
        _leave_stopped()


def _leave_stopped() -> None:
    """The ranks stopped on a signal and saved (train/stop.py): leave now, with STOPPED_EXIT, which
    tells cluster=local's launcher (and torchrun's agent: a non-zero exit) that the ranks stopped
    rather than finished; the launcher reads stopped.json for its line."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOPPED_EXIT)
