"""Host memory, before the ranks of a CPU run start on this machine, and when a rank runs out of it.

A CPU run keeps every parameter's fp32 weight, gradient and two AdamW moments (16 bytes) in host
memory, once per pipeline replica (dp_replicate) and per copy a schedule keeps (DualPipe's mirror).
`check_host_memory` refuses in one line, before any process starts, a run of cluster=local whose
ranks would need more than the machine has available (/proc/meminfo's MemAvailable): a lower bound,
activations come on top. A rank that runs out anyway ("DefaultCPUAllocator: can't allocate
memory", with no word of what to change) gets `oom_hint`'s advice in its one-line error
(launch/errors.py: one_line).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

STATE_BYTES = 16  # fp32 weight + gradient + AdamW's exp_avg and exp_avg_sq, per parameter
ADVICE = ("use a smaller model (or data.batch_size / data.seq_len for the activations), spread the ranks over "
          "machines (cluster=slurm), or train on GPUs (trainer.device=cuda)")
_OOM = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory): "
                  r"you tried to allocate (\d+) bytes")


def available_bytes(meminfo: Path = Path("/proc/meminfo")) -> Optional[int]:
    """MemAvailable (what new processes can use without swapping); None where unknown (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def check_host_memory(config: Any, plan: Any, *, available: Optional[int] = None) -> None:
    """Raise the one-line refusal when a CPU run of cluster=local needs more host memory than the
    machine has available (`available`: MemAvailable unless given)."""
    if config.cluster.name != "local":  # the ranks run on other machines (or torchrun's nodes): not measurable here
        return
    available = available_bytes() if available is None else available
    if available is None:
        return
    train = config.mode.value == "train"
    per, what = (STATE_BYTES, "weights, gradients and AdamW state") if train else (4, "fp32 weights")
    params = sum(plan.partition.chunk_params())
    copies, replicas = plan.schedule.placement.param_copies, config.parallel.dp_replicate
    need = per * params * copies * replicas
    if need <= available:
        return
    times = "".join(f" x {n} {why}" for n, why in ((copies, "copies (the schedule's mirror)"),
                                                   (replicas, "replicas (parallel.dp_replicate)")) if n > 1)
    raise ValueError(f"model={config.model.name} needs at least {need / 1e9:.1f} GB of host memory for its {what} "
                     f"({per} bytes x {params / 1e6:,.1f}M parameters{times}) but this machine has "
                     f"{available / 1e9:.1f} GB available: {ADVICE}")


def oom_hint(message: str) -> Optional[str]:
    """A rank's one line for torch's host out-of-memory error (None for any other message)."""
    found = _OOM.search(message)
    if found is None:
        return None
    return f"out of host memory (allocating {int(found.group(1)) / 1e9:.2f} GB): {ADVICE}"
