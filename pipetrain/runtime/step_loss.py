"""A step's loss as the executor reports it: the last stages' microbatch losses kept as they come and
summed at the step's end (on a GPU on the device: no host sync per microbatch), reduced once over every
rank holding a last stage.

Training adds each microbatch's mean loss (the step's loss is the mean of their means); evaluation adds
each weighted by its counted targets (the mean is per token: padding, token id -1, not counted).

The global-batch loss (issue #46). The loss a step trains on is the mean over the loss tokens of the global
batch: sum over every token t of loss_t / N, N the global batch's counted targets. Microbatch m's loss is
its own mean over its n_m tokens, and the ranks' gradients are averaged over R ranks (dp x cp), so its
backward starts from n_m R / N (not 1/M): summed over a rank's microbatches and averaged over the ranks, the
gradient is d(sum_t loss_t) / N, the same at any M, dp or pp. Where every microbatch of every rank counts
the same n = N / (R M), that seed is exactly 1/M: the trainer then passes no GlobalTokens
(parallel/parallelize.py: global_tokens) and the step runs as before, bit for bit (packed pre-training,
which pads nothing). A microbatch with no loss token (possible with data=sft) gets seed 0 and is left out
of the reported mean (its own mean is 0/0). MoE aux losses keep their 1/M scale (train/moe_hooks.py): a
balance loss is a statistic of each microbatch, not a sum over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GlobalTokens:
    """A step's global batch's loss tokens and the ranks its gradients are averaged over (module docstring)."""

    count: int  # N: targets other than -1 in the global batch
    ranks: int  # R: dp x cp, the ranks whose gradients the reduction averages


class StepLoss:
    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup], num_microbatches: int = 1, *,
                 parts: int = 0) -> None:
        self.device, self.group, self.num_microbatches = device, group, num_microbatches
        self.parts = parts  # P: a loss is a (1 + P,) vector, the loss then P reported parts (0: a scalar)
        self.part_means: tuple[float, ...] = ()  # the last mean()'s parts, averaged as the loss
        self._seeds: dict[tuple, torch.Tensor] = {}  # seed()'s, by the loss's (dtype, shape)
        self.tokens: Optional[GlobalTokens] = None  # this step's, when its microbatches count unequal tokens
        self._counts: list[int] = []  # under GlobalTokens: each microbatch's counted targets
        self.reset()

    def count(self, m: int) -> Optional[int]:
        """Microbatch m's counted targets under GlobalTokens, else None (training's mean of means)."""
        return self._counts[m] if self._counts else None

    def seed(self, loss: torch.Tensor, m: Optional[int] = None) -> torch.Tensor:
        """The gradient a microbatch's loss's backward starts from: 1/M, so that gradients are the
        mean over microbatches. It is the very value a `loss / M` node's backward hands on (ones / M
        in the loss's dtype), without that node in every last-stage forward and backward. One
        read-only tensor per dtype and shape, reused by every microbatch. With GlobalTokens, microbatch `m`'s
        n_m R / N instead (module docstring); 1/M where that is 1/M exactly."""
        count = self.count(m) if m is not None else None
        if self.tokens is not None and count is not None and self.tokens.count:
            share = Fraction(count * self.tokens.ranks, self.tokens.count)
            if share != Fraction(1, self.num_microbatches):
                return torch.full(loss.shape, float(share), dtype=loss.dtype, device=loss.device)
        key = (loss.dtype, loss.shape)
        seed = self._seeds.get(key)
        if seed is None:
            seed = self._seeds[key] = torch.ones(loss.shape, dtype=loss.dtype, device=loss.device) \
                / self.num_microbatches
        return seed

    def reset(self, tokens: Optional[GlobalTokens] = None, targets: Sequence[torch.Tensor] = ()) -> None:
        """A new step (or evaluate()): its GlobalTokens (None: every seed 1/M) and its microbatches'
        targets, counted now where there are GlobalTokens."""
        self.tokens = tokens
        self._counts = [1 if t.is_floating_point() else int((t != -1).sum()) for t in targets] if tokens else []
        self._losses: list[torch.Tensor] = []  # each microbatch's mean loss (detached), summed at mean()
        self._weights: list[int] = []  # evaluation: each one's counted targets
        self._count = 0

    def add(self, loss: torch.Tensor, weight: Optional[int] = None) -> None:
        """A microbatch's mean loss; `weight`: its counted targets (evaluation, and training under
        GlobalTokens), None: one (training).
        Kept, not added: the sum is made once, at the step's end."""
        if weight is None or weight:
            self._losses.append(loss.detach())
            self._weights.append(1 if weight is None else weight)
        self._count += 1 if weight is None else weight

    def _sum(self) -> torch.Tensor | list[float]:
        """Sum of weight * loss in fp64, per element of a (1 + P,) loss (P = 0: one). On a GPU one stacked sum
        on the device (no host sync); on the CPU in Python floats, the same fp64 additions in microbatch
        order, without a tensor op each."""
        if self.device.type != "cpu":
            if not self._losses:
                return torch.zeros(1 + self.parts, dtype=torch.float64, device=self.device)
            losses = torch.stack(self._losses).double().reshape(len(self._losses), -1)  # (n, 1 + P)
            if any(w != 1 for w in self._weights):
                losses = losses * torch.tensor(self._weights, dtype=torch.float64, device=self.device)[:, None]
            return losses.sum(0)
        total = [0.0] * (1 + self.parts)
        for loss, w in zip(self._losses, self._weights):
            for i, v in enumerate(loss.tolist() if loss.dim() else (float(loss),)):
                total[i] += v * w if w != 1 else v
        return total

    def mean(self, synced: Optional[Callable[[], None]] = None) -> Optional[float]:
        """The mean over every rank holding a last stage (and `part_means`, the parts' alike); `synced` is
        called as the all-reduce ends (on GPU stream-ordered after it). No process group: this rank's mean."""
        total = self._sum()
        if self.group is None and not dist.is_initialized():
            sums, count = [float(t) for t in total], float(self._count)
        else:
            if isinstance(total, list):
                buf = torch.tensor([*total, float(self._count)], dtype=torch.float64)
            else:
                dev = self.device if self.device.type == "cuda" else torch.device("cpu")
                buf = torch.cat([total.to(dev), torch.tensor([float(self._count)], dtype=torch.float64, device=dev)])
            dist.all_reduce(buf, group=self.group)
            if synced is not None:
                synced()
            *sums, count = buf.tolist()
        self.part_means = tuple(t / count for t in sums[1:]) if count else ()
        return sums[0] / count if count else None
