"""The MoE presets are the published models: built on meta, their parameter counts are the totals
their authors publish (sources in each conf/model/*.yaml), and their active parameters per token
(the total less the experts a token skips: models/moe_costs.py) the published active counts.

Publishers round totals to 0.1B and active counts loosely (Qwen3-30B-A3B's 3.35B is "3.3B",
Mixtral's 12.88B "12.9B"), so totals must round to the figure and active counts be within 2%.
"""

from __future__ import annotations

import pytest
import torch

from pipetrain.models.factory import build_model
from pipetrain.models.llama_costs import llama_layer_costs, llama_param_count
from pipetrain.models.moe_costs import idle_params

pytestmark = pytest.mark.pure

# preset -> (exact total from the shapes, published total in billions, published active in billions)
PUBLISHED = {
    "mixtral-8x7b": (46_702_792_704, 46.7, 12.9),
    "qwen3-30b-a3b": (30_532_122_624, 30.5, 3.3),
    "qwen2-moe-a2.7b": (14_315_784_192, 14.3, 2.7),
    "olmoe-1b-7b": (6_919_161_856, 6.9, 1.3),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_meta_built_counts_are_the_published_ones(compose, name):
    exact, total_b, active_b = PUBLISHED[name]
    cfg = compose([f"model={name}", "mode=simulate"]).model
    with torch.device("meta"):
        model = build_model("llama", **cfg.knobs())
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)  # not the aux_free bias
    assert counted == llama_param_count(model.config) == exact
    assert round(counted / 1e9, 1) == total_b
    active = counted - idle_params(model.config)
    assert active == pytest.approx(active_b * 1e9, rel=0.02)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_flops_per_token_follow_the_active_parameters(compose, name):
    """Forward matmul FLOPs per token are 2 x the active parameters (less the embedding lookup,
    which multiplies nothing) plus attention's weightless matmuls."""
    cfg = compose([f"model={name}", "mode=simulate"]).model
    knobs = cfg.knobs()
    costs = llama_layer_costs({**knobs, "head_dim": cfg.head_size, "num_key_value_heads": cfg.kv_heads},
                              microbatch=1, seq=1, tflops=1.0)
    active = llama_param_count({**knobs, "head_dim": cfg.head_size, "num_key_value_heads": cfg.kv_heads})
    active -= idle_params(knobs)
    attn = 2 * 2 * 1 * cfg.num_attention_heads * cfg.head_size * cfg.num_hidden_layers
    embed = cfg.vocab_size * cfg.hidden_size
    assert sum(c.flops_per_token for c in costs) == 2 * (active - embed) + attn
