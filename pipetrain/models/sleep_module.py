"""The `sleep` model in torch: layers that take their configured times in F, B and W.

Each layer computes y = x * (1 + mean(w)) with `params_per_layer` weights w (1 by default;
initialised to 0, so y = x) and then sleeps until f_ms have passed since its forward began: its
own ops are part of its F time, as a real layer's are of the cost model's (0.1-0.3 ms a layer on a
loaded 2-core machine, which came on top of f_ms before, and which bench/executor_efficiency.py
counted as the executor's). More weights change nothing but the
gradient's size, which data parallel then really reduces. The mean is taken as sum(w) / n:
the division is on the scalar, so the backward is a stride-0 view of the scalar gradient and
W costs one in-place add into `.grad` per microbatch (~0.7 ms for 3M weights); torch's mean
backward would first write a divided copy (~7 ms). A plain sum would step sum(w) by n x lr.

The backward is split across two autograd nodes so that the autograd engine itself decides
which sleep runs:

    x --SleepB(b_ms)--> x1 --+
                             +--> addcmul(x1, x1, w1) = x1 + x1 * w1 --> y
    w --mean--SleepW(w_ms)--> w1 --+

SleepB and SleepW are identity functions whose backward sleeps, then passes the gradient
through. The engine only runs nodes on a path from the outputs to the requested inputs:
  - B, torch.autograd.grad(y, x): runs addcmul's backward and SleepB only -> b_ms per layer;
  - W, torch.autograd.grad(y, [w]) on the retained graph: addcmul's backward and SleepW only
    -> w_ms, but only if it starts at the layer's own output. For a stage of several
    layers, W must start from the gradients B saw at each layer (torch's
    stage_backward_input / stage_backward_weight in torch/distributed/pipelining/_backward.py
    do exactly this: B records the gradient arriving at the first node of each weight's
    subgraph, W resumes from there), or W would re-run the later layers' SleepB;
  - a full backward (BW) runs both: b_ms + w_ms per layer.
On the first stage the input usually does not require grad, so SleepB never runs; give
the stage input requires_grad (it is a float tensor) to keep B's time there.

x1 is a fresh (B, hidden) tensor that addcmul saves for W: the `hidden` floats per sample
each layer holds until its backward, so peak memory is measurable.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.base import LayeredModel, TensorSpec
from pipetrain.partition.costs import LayerCost

# time.sleep overshoots (timer slack, wake-up): ~0.1 ms idle, more on a loaded machine,
# which is 5-10% of a 2 ms layer. Each call measures its own overshoot and the next call
# sleeps that much less (at most _MAX_CREDIT_MS less), so the sleeps of a process add up
# to their configured total instead of drifting. We do not spin to the deadline: a spin
# burns a core, and the point of this model is that 8 ranks share 2 cores without
# competing. Executor overhead between sleeps is not compensated: benchmarks see it (a
# forward's own ops before its sleep are the layer's: `since`).
_MAX_CREDIT_MS = 1.0
_overslept_ms = 0.0


def sleep_ms(ms: float, since: Optional[float] = None) -> None:
    """Block the calling thread until about `ms` milliseconds have passed since `since` (a perf_counter
    reading; None: now) without using the CPU: what ran since then counts toward the `ms`."""
    global _overslept_ms
    if ms <= 0:
        return
    t0 = time.perf_counter()
    start = t0 if since is None else since
    credit = min(_overslept_ms, _MAX_CREDIT_MS, ms)
    left = ms - credit - (t0 - start) * 1e3
    if left > 0:
        time.sleep(left / 1e3)
    actual = (time.perf_counter() - start) * 1e3
    _overslept_ms = max(0.0, _overslept_ms - credit + (actual - (ms - credit)))


class _SleepOnBackward(torch.autograd.Function):
    """Identity (a copy) in forward; the backward sleeps `ms` and passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ms: float) -> torch.Tensor:
        ctx.ms = ms
        return x.clone()  # a fresh tensor: the activation this layer keeps (see module docstring)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        sleep_ms(ctx.ms)
        return grad, None


class SleepLayer(nn.Module):
    def __init__(self, *, f_ms: float, b_ms: float, w_ms: float, params: int = 1) -> None:
        super().__init__()
        self.f_ms, self.b_ms, self.w_ms = f_ms, b_ms, w_ms
        self.weight = nn.Parameter(torch.zeros(params))  # y = x * (1 + mean(w)): identity at init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        x1 = _SleepOnBackward.apply(x, self.b_ms)  # (B, hidden); B's sleep lives on this path
        # (); W's sleep lives on this path. The mean before the sleep: only a scalar is copied.
        w1 = _SleepOnBackward.apply(self.weight.sum() / self.weight.numel(), self.w_ms)
        y = torch.addcmul(x1, x1, w1)  # x1 + x1 * w1 -> (B, hidden)
        sleep_ms(self.f_ms, since=t0)  # the layer's own ops are part of its F time
        return y


class SleepModel(LayeredModel):
    """Knobs named as SleepModelConfig: layers, f_ms, b_ms, w_ms, hidden, params_per_layer."""

    family = "sleep"

    def __init__(self, *, layers: int = 16, f_ms: float = 2.0, b_ms: float = 2.0, w_ms: float = 2.0,
                 hidden: int = 1024, params_per_layer: int = 1, seed: int = 0) -> None:
        super().__init__()
        if min(layers, hidden, params_per_layer) < 1:
            raise ValueError(f"model.layers, model.hidden and model.params_per_layer must be >= 1 "
                             f"(got {layers}, {hidden}, {params_per_layer})")
        for knob, value in (("f_ms", f_ms), ("b_ms", b_ms), ("w_ms", w_ms)):
            if value < 0:
                raise ValueError(f"model.{knob} must be >= 0 ms (got {value})")
        self._config = dict(layers=layers, f_ms=f_ms, b_ms=b_ms, w_ms=w_ms, hidden=hidden,
                            params_per_layer=params_per_layer)
        self.layers = nn.ModuleList(SleepLayer(f_ms=f_ms, b_ms=b_ms, w_ms=w_ms, params=params_per_layer)
                                    for _ in range(layers))
        self.layer_names = [f"layers.{i}" for i in range(layers)]  # as sleep.sleep_layer_costs
        self.reset_parameters(seed)

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        nn.init.zeros_(value)  # y = x * (1 + w): every layer starts as the identity, whatever the seed

    @staticmethod
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def boundary_specs(self, *, microbatch: int, seq: int = 1) -> list[TensorSpec]:
        spec = TensorSpec((microbatch, self._config["hidden"]), self.param_dtype)
        return [spec] * (self._config["layers"] + 1)

    def target_spec(self, *, microbatch: int, seq: int = 1) -> TensorSpec:
        return TensorSpec((microbatch, self._config["hidden"]), self.param_dtype)

    def example_batch(
        self, *, microbatch: int, seq: int = 1, generator: torch.Generator | None = None, device: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (microbatch, self._config["hidden"])
        x = torch.randn(shape, generator=generator, dtype=self.param_dtype)
        return x.to(device), torch.randn(shape, generator=generator, dtype=self.param_dtype).to(device)

    def cost_model(self, *, microbatch: int = 1, seq: int = 1, tflops: float = 1.0) -> list[LayerCost]:
        return super().cost_model(microbatch=microbatch, seq=seq, tflops=tflops)  # whatever the batch or device
