"""The `sleep` model's cost model: every layer takes exactly its configured times.

Its layers are what the simulator and (later) the executor agree on exactly, which
makes it the yardstick for schedule efficiency on machines with few cores.
"""

from __future__ import annotations

from pipetrain.partition.costs import LayerCost


def sleep_layer_costs(*, layers: int, f_ms: float, b_ms: float, w_ms: float, hidden: int,
                      params_per_layer: int = 1) -> list[LayerCost]:
    # Each layer holds `params_per_layer` fp32 weights (sleep_module.SleepLayer: y = x * (1 + mean(w)))
    # and saves one activation of `hidden` fp32 values per sample.
    return [
        LayerCost(f"layers.{i}", f_ms, b_ms, w_ms, params=params_per_layer, activation_bytes_per_token=4 * hidden)
        for i in range(layers)
    ]
