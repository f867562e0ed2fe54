"""A step's loss as the executor reports it: the last stages' microbatch losses summed on the device (no
host sync per microbatch), reduced once over every rank holding a last stage at the step's end.

Training adds each microbatch's mean loss (the step's loss is the mean of their means); evaluation adds
each weighted by its counted targets (the mean is per token: padding, token id -1, not counted).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


class StepLoss:
    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup]) -> None:
        self.device, self.group = device, group
        self.reset()

    def reset(self) -> None:
        self._sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._count = 0

    def add(self, loss: torch.Tensor, weight: Optional[int] = None) -> None:
        """A microbatch's mean loss; `weight`: its counted targets (evaluation), None: one (training)."""
        if weight is None:
            self._sum += loss.detach()  # added in fp64 (the sum's dtype), as .double() would
            self._count += 1
        else:
            self._sum += loss.detach().double() * weight if weight else 0.0
            self._count += weight

    def mean(self, synced: Optional[Callable[[], None]] = None) -> Optional[float]:
        """The mean over every rank holding a last stage; `synced` is called as the all-reduce ends (on
        GPU stream-ordered after it). No process group: this rank's mean."""
        if self.group is None and not dist.is_initialized():
            return float(self._sum / self._count) if self._count else None
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        buf = torch.stack([self._sum.to(dev), torch.tensor(float(self._count), dtype=torch.float64, device=dev)])
        dist.all_reduce(buf, group=self.group)
        if synced is not None:
            synced()
        total, count = buf.tolist()
        return total / count if count else None
