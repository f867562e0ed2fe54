"""A step's loss as the executor reports it: the last stages' microbatch losses kept as they come and
summed at the step's end (on a GPU on the device: no host sync per microbatch), reduced once over every
rank holding a last stage.

Training adds each microbatch's mean loss (the step's loss is the mean of their means); evaluation adds
each weighted by its counted targets (the mean is per token: padding, token id -1, not counted).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


class StepLoss:
    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup], num_microbatches: int = 1) -> None:
        self.device, self.group, self.num_microbatches = device, group, num_microbatches
        self._seeds: dict[tuple, torch.Tensor] = {}  # seed()'s, by the loss's (dtype, shape)
        self.reset()

    def seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The gradient a microbatch's loss's backward starts from: 1/M, so that gradients are the
        mean over microbatches. It is the very value a `loss / M` node's backward hands on (ones / M
        in the loss's dtype), without that node in every last-stage forward and backward. One
        read-only tensor per dtype and shape, reused by every microbatch."""
        key = (loss.dtype, loss.shape)
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = torch.ones(loss.shape, dtype=loss.dtype, device=loss.device) \
                / self.num_microbatches
        return seed

    def reset(self) -> None:
        self._losses: list[torch.Tensor] = []  # each microbatch's mean loss (detached), summed at mean()
        self._weights: list[int] = []  # evaluation: each one's counted targets
        self._count = 0

    def add(self, loss: torch.Tensor, weight: Optional[int] = None) -> None:
        """A microbatch's mean loss; `weight`: its counted targets (evaluation), None: one (training).
        Kept, not added: the sum is made once, at the step's end."""
        if weight is None or weight:
            self._losses.append(loss.detach())
            self._weights.append(1 if weight is None else weight)
        self._count += 1 if weight is None else weight

    def _sum(self) -> torch.Tensor | float:
        """Sum of weight * loss in fp64. On a GPU one stacked sum on the device (no host sync); on the
        CPU in Python floats, the same fp64 additions in microbatch order, without a tensor op each."""
        if self.device.type != "cpu":
            if not self._losses:
                return torch.zeros((), dtype=torch.float64, device=self.device)
            losses = torch.stack(self._losses).double()
            if any(w != 1 for w in self._weights):
                losses = losses * torch.tensor(self._weights, dtype=torch.float64, device=self.device)
            return losses.sum()
        total = 0.0
        for loss, w in zip(self._losses, self._weights):
            total += float(loss) * w if w != 1 else float(loss)
        return total

    def mean(self, synced: Optional[Callable[[], None]] = None) -> Optional[float]:
        """The mean over every rank holding a last stage; `synced` is called as the all-reduce ends (on
        GPU stream-ordered after it). No process group: this rank's mean."""
        total = self._sum()
        if self.group is None and not dist.is_initialized():
            return float(total) / self._count if self._count else None
        if isinstance(total, float):
            buf = torch.tensor([total, float(self._count)], dtype=torch.float64)
        else:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            buf = torch.stack([total.to(dev), torch.tensor(float(self._count), dtype=torch.float64, device=dev)])
        dist.all_reduce(buf, group=self.group)
        if synced is not None:
            synced()
        total, count = buf.tolist()
        return total / count if count else None
