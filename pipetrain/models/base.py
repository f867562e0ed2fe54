"""The interface every runnable model shares: an ordered list of layers plus what the
pipeline needs to know about them ahead of time.

A pipeline cuts a model between layers, so a model here *is* its layer list:
`layers[0]` takes the model input, `layers[-1]` produces what `loss` consumes, and
`forward` just chains them. The unsplit model names its parameters `layers.{i}.{rest}`;
split.py keeps exactly those names on every stage, so checkpoints written by stages
load into the unsplit model and back.

Besides the layers, a model tells the executor (runtime/) and the partitioners:
  - `boundary_specs`: shape and dtype of the tensor crossing each layer boundary for one
    microbatch, so P2P buffers are allocated ahead instead of negotiated per message;
  - `cost_model`: analytic per-layer `LayerCost` (params, forward FLOPs, activation bytes,
    estimated ms); profile.py replaces the estimated ms by measured ones;
  - `example_batch`: random tensors of the right shapes, dtypes and ranges (for profiling
    and tests; real data lives in train/);
  - `init_parameter`: the initial value of one parameter, by its unsplit name, drawn from a
    generator seeded by (seed, name) (init.py): built on the meta device, a model is
    materialized stage by stage with the same weights as the unsplit model built for real.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pipetrain.models.costs import family_layer_costs
from pipetrain.models.init import init_parameters
from pipetrain.partition.costs import LayerCost

# trainer.precision -> the stages' compute dtype (None: no autocast, boundaries in the parameters' dtype)
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor crossing a layer boundary (one microbatch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised buffer of this spec, e.g. for a posted receive."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LayeredModel(nn.Module):
    """Base class: subclasses fill `self.layers` and `self.layer_names` in `__init__` and
    implement the abstract methods below. Everything else (splitting, profiling) works on
    this interface alone."""

    layers: nn.ModuleList
    layer_names: list[str]

    # -- to implement ------------------------------------------------------------------
    @staticmethod
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of one microbatch: a plain function (no `self`), so a stage can carry it
        without keeping a reference to the whole unsplit model."""
        raise NotImplementedError

    _config: dict[str, Any]  # subclasses store their constructor keyword arguments here

    @property
    def config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-able): the model is rebuilt from these alone."""
        return dict(self._config)

    def boundary_specs(self, *, microbatch: int, seq: int) -> list[TensorSpec]:
        """len(layers) + 1 specs: [0] is the model input, [i] the output of layer i - 1 (so
        a stage holding layers range(a, b) receives spec [a] and sends spec [b])."""
        raise NotImplementedError

    def target_spec(self, *, microbatch: int, seq: int) -> TensorSpec:
        raise NotImplementedError

    family: ClassVar[str]  # the model config's family (config/models.py): its cost model's name (models/costs.py)

    def cost_model(self, *, microbatch: int, seq: int, tflops: float) -> list[LayerCost]:
        """One LayerCost per layer, times for one microbatch of `microbatch` x `seq`: the family's formula over
        this model's config (models/costs.py, what the launcher and the planner read without building it)."""
        return family_layer_costs(self.family, self._config, microbatch=microbatch, seq=self._seq(seq),
                                  tflops=tflops, bytes_per_value=self._bytes_per_value())

    def _seq(self, seq: int) -> int:
        """`seq` checked against the longest sequence the model takes (no sequence axis here: any)."""
        return seq

    def _bytes_per_value(self) -> int:
        return torch.empty((), dtype=self.param_dtype, device="meta").element_size()

    def example_batch(
        self, *, microbatch: int, seq: int, generator: torch.Generator | None = None, device: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, target) with random values of the right shapes, dtypes and ranges."""
        raise NotImplementedError

    def init_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `value` (fp32, CPU, the parameter's shape) with the initial value of the
        parameter `name` (unsplit name, `layers.{i}.{rest}`), drawing only from `generator`.
        May look the owning module up with `self.get_submodule` (it exists on meta too)."""
        raise NotImplementedError

    @property
    def loss_parts(self) -> int:
        """How many parts each microbatch's loss reports beside the loss (runtime/step_loss.py); 0: a scalar."""
        return 0

    # -- shared ------------------------------------------------------------------------
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from (seed, its name); a model on meta stays on meta
        (its stages are materialized by split.build_stage with the same seed)."""
        if all(p.device.type != "meta" for p in self.parameters()):
            init_parameters(self, self, seed=seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return type(self).loss_fn(output, target)

    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype
