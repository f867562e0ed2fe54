"""Every model family's per-layer costs from its config alone, pure arithmetic (no torch): the one function
`mode=simulate`, the run's partition and the planner cost a model's layers by (plan.py model_layer_costs), and
what each model's `cost_model` answers (models/base.py), so a launcher costs a GPT-2 or a Llama without
building it. The families' formulas live beside their layers' sizes (gpt2_costs.py, llama_costs.py,
deepseek_costs.py, sleep.py); the MLP's, a few lines, here."""

from __future__ import annotations

from typing import Any, Callable

from pipetrain.config.models import ModelConfig
from pipetrain.models.deepseek_costs import deepseek_layer_costs
from pipetrain.models.gpt2_costs import gpt2_layer_costs
from pipetrain.models.llama_costs import llama_layer_costs
from pipetrain.models.sleep import sleep_layer_costs
from pipetrain.partition.costs import LayerCost, ms_from_flops

FLOAT32_BYTES = 4  # every model here keeps fp32 parameters (bf16 runs autocast them): the cost models' values


def mlp_layer_costs(cfg: dict[str, Any], *, microbatch: int, seq: int = 1, tflops: float,
                    bytes_per_value: int = FLOAT32_BYTES) -> list[LayerCost]:
    """models/mlp.py's layers: 2 FLOPs per weight per sample each for F, B and W; a layer keeps its input and
    (when it has tanh, all but the last) its output for the backward. No sequence axis: `seq` is ignored."""
    n = cfg["n_layer"]
    widths = [cfg["d_in"], *[cfg["d_hidden"]] * (n - 1), cfg["d_out"]]
    out = []
    for i in range(n):
        params = widths[i] * widths[i + 1] + widths[i + 1]
        ms = ms_from_flops(2 * params * microbatch, tflops)
        kept = widths[i] + (widths[i + 1] if i < n - 1 else 0)
        out.append(LayerCost(f"fc.{i}", ms, ms, ms, params=params, flops_per_token=2.0 * params,
                             activation_bytes_per_token=kept * bytes_per_value))
    return out


def _gpt2(cfg: dict[str, Any], **kw: Any) -> list[LayerCost]:
    return gpt2_layer_costs(**cfg, **kw)


def _sleep(cfg: dict[str, Any], **_: Any) -> list[LayerCost]:
    return sleep_layer_costs(**cfg)  # what the layers sleep, whatever the batch or device


FAMILY_COSTS: dict[str, Callable[..., list[LayerCost]]] = {
    "gpt2": _gpt2, "llama": llama_layer_costs, "deepseek": deepseek_layer_costs, "mlp": mlp_layer_costs,
    "sleep": _sleep,
}


def family_layer_costs(family: str, cfg: dict[str, Any], *, microbatch: int, seq: int, tflops: float,
                       bytes_per_value: int = FLOAT32_BYTES) -> list[LayerCost]:
    """One LayerCost per pipeline layer of a `family` model whose resolved knobs are `cfg` (the model's own
    `config`), for one microbatch of `microbatch` x `seq` at `tflops` sustained TFLOP/s."""
    return FAMILY_COSTS[family](cfg, microbatch=microbatch, seq=seq, tflops=tflops, bytes_per_value=bytes_per_value)


def config_layer_costs(m: ModelConfig, *, microbatch: int, seq: int, tflops: float) -> list[LayerCost]:
    """family_layer_costs of a model config (config/models.py ModelConfig: its `family` and resolved knobs)."""
    return family_layer_costs(m.family, m.resolved_knobs(), microbatch=microbatch, seq=seq, tflops=tflops)
