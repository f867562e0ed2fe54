"""Rank processes on CPU (gloo) start by forking a server that has already imported torch and
the trainer, instead of each importing them anew (multiprocessing's "forkserver" start method).

A spawned rank spends about 2 s of CPU importing torch and pipetrain before it runs a line of
its own; 4 ranks on 2 cores wait 4 s for that at every launch. The server pays it once per
launching process (and `warm()` starts it early, while the launcher still composes and simulates),
after which a rank starts in milliseconds. A rank still starts as a spawned one would, from what
the launching process has at the moment it launches: its environment (the server's own is the
one it was started with) and its stdout/stderr (passed along as file descriptors). NCCL ranks
keep the spawn start method: a GPU run's start-up is small next to it, and nothing CUDA-related
is ever forked.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from multiprocessing import reduction
from typing import Iterator, Optional, Sequence

# glibc hands large freed blocks back to the kernel, so a training step that frees and
# re-allocates activations page-faults on every allocation; keeping freed memory makes CPU
# steps 10-30% faster (bench/split_backward.py measures it). Read by malloc at process
# start, so it is set in the environment the ranks (and the server they fork from) start with;
# a user's own value wins.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "2000000000",
                  "MALLOC_TOP_PAD_": "268435456"}


@contextlib.contextmanager
def inherited_environ(extra: dict[str, str]) -> Iterator[None]:
    """Variables the spawned workers inherit (read by malloc at process start); a user's own value wins."""
    added = {k: v for k, v in extra.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


# What a rank imports before it runs: the trainer's rank entry and the runtime it drives, and torch's
# distributed checkpoint, which a run's save (trainer.ckpt_at_end, on by default) or resume imports
# (with torch.distributed.tensor and sympy: ~0.5 s, 1 s a rank when both ranks import it at once on 2
# cores), ~2 s of CPU in all paid once here rather than once per rank, while the launcher composes and
# checks. First: pipetrain.launch.parent, which makes the server die with its launcher (read it for why).
PRELOAD = ["pipetrain.launch.parent", "torch", "torch.distributed", "pipetrain.launch.rank",
           "pipetrain.train.trainer", "torch.distributed.checkpoint"]
# torch._dynamo (~1.4 s more) only where the ranks compile (trainer.compile): the optimizer no longer
# imports it (compat.AdamW), and a preload that nobody needs is on every run's critical path.
COMPILE_PRELOAD = ["torch._dynamo"]


def preload(*, compile: bool = False) -> list[str]:
    return PRELOAD + (COMPILE_PRELOAD if compile else [])


# The environment this module was imported with: in the server, the one every forked rank inherits
# before it takes the launcher's (`adopt`).
_IMPORT_ENV = dict(os.environ)


def start_method(backend: str) -> str:
    return "forkserver" if backend == "gloo" else "spawn"


def warm(backend: str = "gloo", *, compile: bool = False) -> None:
    """Start the server (if not running) so that its imports overlap the launcher's own work. It
    starts with the malloc settings above, which every rank it forks keeps (malloc reads them once).
    compile: its ranks will torch.compile, so it preloads torch._dynamo too."""
    if start_method(backend) != "forkserver":
        return
    import threading

    from pipetrain.launch.parent import SERVER_ENV

    # The kernel's parent-death signal fires when the *thread* that started the server ends: only
    # a server started from the main thread (the launcher's, always so far) may ask for it.
    dies_with = {SERVER_ENV: str(os.getpid())} if threading.current_thread() is threading.main_thread() else {}
    with inherited_environ({**CPU_MALLOC_ENV, **dies_with}):
        multiprocessing.set_forkserver_preload(preload(compile=compile))
        multiprocessing.forkserver.ensure_running()


class Inherit:
    """What a rank takes from its launcher at launch time, as a spawned process would: the
    environment and stdout/stderr. Built in the launching process and pickled with the rank's
    arguments; the file descriptors travel as multiprocessing's DupFd, which only works while a
    forkserver child is being started (a spawned child inherits them anyway)."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.launcher = os.getpid()
        self.fds: list[int] | None = None

    def __getstate__(self) -> dict:
        fds = None
        if _forking():
            sys.stdout.flush()
            sys.stderr.flush()
            fds = [reduction.DupFd(fd) for fd in (1, 2)]
        return {"environ": self.environ, "launcher": self.launcher, "fds": fds}

    def __setstate__(self, state: dict) -> None:
        self.environ, self.launcher = state["environ"], state["launcher"]
        self.fds = None if state["fds"] is None else [d.detach() for d in state["fds"]]

    def adopt(self) -> None:
        """In the rank: the launcher's environment plus what the start method set for this rank
        (the launcher's RANK, LOCAL_RANK, ...), and the launcher's stdout/stderr; and death with
        the launcher (launch/parent.py). Call it first."""
        import signal

        from pipetrain.launch.parent import die_with_parent

        if self.fds is not None:  # forked from the server, which ignores SIGTERM (launch/parent.py)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        die_with_parent(self.launcher)
        own = {k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(own)
        for target, fd in zip((1, 2), self.fds or ()):
            os.dup2(fd, target)
            os.close(fd)


def _forking() -> bool:
    """Whether this pickling happens while multiprocessing starts a forkserver child."""
    from multiprocessing import context

    popen = context.get_spawning_popen()
    return popen is not None and type(popen).__module__ == "multiprocessing.popen_forkserver"


def prestart_early(argv: Sequence[str]) -> None:
    """launcher.prestart() from the command line alone, at the command's first frame (pipetrain/__main__.py,
    then cli.main, where it is a no-op), where `early_start(argv)` says so: the server's imports then
    overlap the command's own (Hydra, the schemas: ~0.4 s), Hydra's composing and the config's checks."""
    compile = early_start(argv)
    if compile is not None:
        warm("gloo", compile=compile)


def early_start(argv: Sequence[str]) -> Optional[bool]:
    """Whether `pipetrain ARGV` surely wants prestart()'s server (None: not surely; else whether its
    ranks compile). Only where the command line leaves the shipped defaults' answer standing (mode=train
    on cluster=local, the CPU unless a GPU fits: prestart's case): no flag, no recipe (one may set the
    mode), no mode but train or eval, no cluster, backend, device or Hydra launcher override. A config
    that composes otherwise (a mistake in it) costs the server's start: it dies with the command
    (launch/parent.py)."""
    given: dict[str, str] = {}
    for arg in argv:
        key, _, value = arg.partition("=")
        if arg.startswith(("-", "~")) or key.lstrip("+").startswith(("recipe", "cluster", "hydra/")):
            return None
        given[key.lstrip("+")] = value
    if given.get("mode", "train") not in ("train", "eval") or given.get("trainer.device", "auto") == "cuda":
        return None
    return given.get("trainer.compile", "false").lower() == "true"
