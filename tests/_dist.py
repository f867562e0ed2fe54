"""Real multi-process gloo runs for tests: one process per rank, no mocks."""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, Path(out), *args)
    except BaseException as e:  # record what this rank saw, then fail the process
        (Path(out) / f"error{rank}.txt").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    dist.destroy_process_group()


def spawn(fn, world: int, out: Path, *args, join: bool = True):
    """Run fn(rank, world, out, *args) in `world` gloo processes; returns the process context."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), str(out), fn, args), nprocs=world,
                             join=False, start_method="spawn")
    if join:
        while not ctx.join():
            pass
    return ctx
