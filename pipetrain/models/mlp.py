"""A small stack of linear layers: the fastest model with real gradients, for tests.

Layer 0 maps d_in -> d_hidden, the middle layers d_hidden -> d_hidden, the last
d_hidden -> d_out, each followed by tanh except the last (a regression output). Widths
differ on purpose, so the executor's per-boundary shapes are exercised. Input (B, d_in)
float; loss is the MSE against a (B, d_out) target. There is no sequence axis: `seq` is
accepted for the common interface and ignored (one sample = one token).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.models.base import LayeredModel, TensorSpec
from pipetrain.partition.costs import LayerCost


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int, *, activation: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)  # (B, d_in) -> (B, d_out)
        return torch.tanh(y) if self.activation else y


class MLPModel(LayeredModel):
    family = "mlp"

    def __init__(self, *, n_layer: int = 4, d_in: int = 16, d_hidden: int = 32, d_out: int = 8,
                 seed: int = 0) -> None:
        super().__init__()
        for knob, value in (("n_layer", n_layer), ("d_in", d_in), ("d_hidden", d_hidden), ("d_out", d_out)):
            if value < 1:
                raise ValueError(f"model.{knob} must be >= 1 (got {value})")
        self._config = dict(n_layer=n_layer, d_in=d_in, d_hidden=d_hidden, d_out=d_out)
        self._widths = [d_in, *[d_hidden] * (n_layer - 1), d_out]  # boundary i has width _widths[i]
        self.layers = nn.ModuleList(
            Dense(self._widths[i], self._widths[i + 1], activation=i < n_layer - 1) for i in range(n_layer)
        )
        self.layer_names = [f"fc.{i}" for i in range(n_layer)]
        self.reset_parameters(seed)

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        # nn.Linear's own default: weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        # (kaiming_uniform with a = sqrt(5)), drawn from the parameter's generator.
        fan_in = self.get_submodule(name.rpartition(".")[0]).in_features
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(value, -bound, bound, generator=generator)

    @staticmethod
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def boundary_specs(self, *, microbatch: int, seq: int = 1) -> list[TensorSpec]:
        return [TensorSpec((microbatch, w), self.param_dtype) for w in self._widths]

    def target_spec(self, *, microbatch: int, seq: int = 1) -> TensorSpec:
        return TensorSpec((microbatch, self._config["d_out"]), self.param_dtype)

    def example_batch(
        self, *, microbatch: int, seq: int = 1, generator: torch.Generator | None = None, device: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(microbatch, self._config["d_in"], generator=generator, dtype=self.param_dtype)
        y = torch.randn(microbatch, self._config["d_out"], generator=generator, dtype=self.param_dtype)
        return x.to(device), y.to(device)

    def cost_model(self, *, microbatch: int, seq: int = 1, tflops: float) -> list[LayerCost]:
        return super().cost_model(microbatch=microbatch, seq=seq, tflops=tflops)  # no sequence axis: seq ignored
