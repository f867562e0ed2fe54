"""Run a function in one process per pipeline rank on this machine (gloo or NCCL).

Each rank initialises the default process group over a loopback rendezvous, runs
`fn(rank, world, out_dir, *args)`, and on failure writes `error{rank}.txt` (first line:
the one-line message) into `out_dir` before exiting non-zero.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.launch import forkserver
from pipetrain.launch.forkserver import CPU_MALLOC_ENV, inherited_environ


TIMEOUT = datetime.timedelta(seconds=300)


def _entry(rank: int, world: int, port: int, out: str, backend: str, threads: int, fn: Callable, args: tuple,
           inherit: forkserver.Inherit) -> None:
    inherit.adopt()
    torch.set_num_threads(threads)  # ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        fn(rank, world, Path(out), *args)
    except BaseException as e:
        (Path(out) / f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    dist.destroy_process_group()


def spawn_local(
    fn: Callable[..., Any], world: int, out: Path, *args: Any,
    backend: str = "gloo", threads: int = 1, join: bool = True,
) -> mp.ProcessContext:
    """Start `world` processes running fn; with join=True wait for all (raising if one fails).

    The rendezvous store is this process's, bound to a port the kernel picks and held while the
    ranks live (on the context): a port found free and let go for a rank to bind could be taken
    in between by another run on the machine (EADDRINUSE under parallel tests)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    forkserver.warm(backend)
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    with inherited_environ(CPU_MALLOC_ENV if backend == "gloo" else {}):
        ctx = mp.start_processes(_entry, args=(world, store.port, str(out), backend, threads, fn, args,
                                               forkserver.Inherit()),
                                 nprocs=world, join=False, start_method=forkserver.start_method(backend))
    ctx.store = store  # type: ignore[attr-defined]  # lives as long as the ranks' context
    if join:
        while not ctx.join():
            pass
    return ctx


def worker_pids(launcher: int) -> list[int]:
    """The rank processes a launcher started (cluster=local's workers), oldest first: what a test or
    a benchmark kills to play a dying rank. Spawned ranks are the launcher's children; forked ones
    (launch/forkserver.py) the children of its fork server. Linux (/proc)."""
    children: dict[int, list[tuple[int, bytes]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append((int(stat.parent.name), cmd))
    out = [pid for pid, cmd in children.get(launcher, []) if b"spawn_main" in cmd]
    for server, cmd in children.get(launcher, []):
        if b"multiprocessing.forkserver" in cmd:
            out += [pid for pid, _ in children.get(server, [])]
    return sorted(out)
