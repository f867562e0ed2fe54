"""Build a runnable model by name: a GPT-2 preset, `llama` (any Llama-family shape), `deepseek` (MLA +
DeepSeekMoE), `mlp` or `sleep`, plus knob overrides (and `seed=`, the initial weights: models/init.py)."""

from __future__ import annotations

from typing import Any

from pipetrain.models.base import LayeredModel
from pipetrain.models.deepseek import DeepSeek
from pipetrain.models.gpt2 import GPT2, PRESETS
from pipetrain.models.llama import Llama
from pipetrain.models.mlp import MLPModel
from pipetrain.models.sleep_module import SleepModel

MODEL_NAMES = (*PRESETS, "llama", "deepseek", "mlp", "sleep")


def build_model(name: str, **knobs: Any) -> LayeredModel:
    """`build_model("gpt2", dropout=0.1)`, `build_model("sleep", layers=8, f_ms=1.0)`, ..."""
    if name in PRESETS:
        return GPT2.from_preset(name, **knobs)
    if name == "llama":
        return Llama(**knobs)
    if name == "deepseek":
        return DeepSeek(**knobs)
    if name == "mlp":
        return MLPModel(**knobs)
    if name == "sleep":
        return SleepModel(**knobs)
    raise ValueError(f"model={name!r} is unknown: choose one of {', '.join(MODEL_NAMES)}")
