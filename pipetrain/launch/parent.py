"""A rank dies with the process that started it (Linux: prctl PR_SET_PDEATHSIG; no torch).

Without it a `kill -9` of the `pipetrain` launcher (or of torchrun's agent) leaves its ranks
training to the last step with nobody to report to, and a relaunch in the same directory meets
them there. The kernel sends SIGKILL to a process whose parent ends, whatever ended the parent, if
the process asked for it; the chain of parents is

    launcher -> fork server -> CPU rank          (launch/forkserver.py; gloo)
    launcher -> rank                             (spawn; NCCL)
    torchrun agent -> rank                       (cluster=torchrun)

The fork server does not end with the launcher by itself: multiprocessing hands every forked
child the server's "alive" pipe, so the server waits for its last child, and the ranks for the
server. So the server asks too, when it imports this module first of its preloads (and ignores
SIGTERM: serve_until_launcher_ends), and each rank asks in `Inherit.adopt()` (CPU and NCCL ranks
of cluster=local) or in `launch()` (torchrun).

SIGKILL, not SIGTERM: a rank that lost its launcher has nobody to restart or report it; the last
checkpoint is complete (they are written atomically) and `trainer.resume=auto` resumes from it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Optional

# Set (to the launcher's pid) only while the launcher starts its fork server: the one process that
# imports this module with it set and with that parent is the server.
SERVER_ENV = "PIPETRAIN_FORKSERVER_OF"
_PR_SET_PDEATHSIG = 1

# The parent this process started under, read at import (before torch's seconds of imports): a
# torchrun rank that lost its agent during those seconds has another parent when it asks.
STARTED_UNDER = os.getppid()


def _parent_of(pid: int) -> Optional[int]:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def die_with_parent(launcher: Optional[int]) -> None:
    """SIGKILL this process when its parent ends. `launcher`: the pid that started us, directly or
    through its fork server; if our parent is neither it nor its child, the launcher ended before
    we asked (no signal will come) and we end now. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    parent = os.getppid()
    if launcher is not None and launcher not in (parent, _parent_of(parent)):
        os.kill(os.getpid(), signal.SIGKILL)


def serve_until_launcher_ends() -> None:
    """In the fork server: end with the launcher, and only then. A SIGTERM to the launcher's whole
    process group (scancel, `kill -- -PGID`) must not end the server: its ranks would die with it,
    before they finish and save the step they are in (train/stop.py). Its forked ranks inherit the
    ignored SIGTERM; `Inherit.adopt()` gives them the default back."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(os.getppid())


if os.environ.get(SERVER_ENV) == str(os.getppid()):  # in the fork server, while it preloads
    serve_until_launcher_ends()
