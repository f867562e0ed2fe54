"""A step's microbatches as the executor reads them: on the device, and counted.

Inputs and targets move to the device once per step, before the step's first action, from
pinned memory and without blocking. A host-to-device copy from pageable memory synchronises
the stream: inside the step (at every first-stage forward, at every loss) the host would wait
for all the compute queued before it, emptying the GPU's queue each time. Only a few KB move;
the cost was the wait, not the bytes.
"""

from __future__ import annotations

import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) each: a batch or a microbatch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: to a GPU from pinned memory, non-blocking (the stream goes on; the
    caching host allocator keeps the pinned copy until the transfer is done); on the CPU the
    tensor itself (no copy)."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def counted_targets(target: torch.Tensor) -> int:
    """Targets a microbatch's loss averages over: token ids other than -1 (the loss's
    ignore_index); a regression target (floats) counts as one."""
    return 1 if target.is_floating_point() else int((target != -1).sum())
