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
from pipetrain.models.moe_costs import experts_active, moe_config
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


# ---- what the planner reads of a model beside its layers' costs (planner/cmd.py workload) ------------------
# Each equals what models/profile.py measures on the model built on meta (tests/test_models_config.py checks
# every family), so that mode=plan of a preset imports no torch either.
COPY_BYTES = {"fp32": 0, "bf16": 2}  # the compute dtype autocast copies a Linear weight to (models/base.py)


def gqa_linear(cfg: dict[str, Any]) -> int:
    """Grouped-query attention's Linear weights: q, k, v and o."""
    c, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return c * (q + 2 * kv) + q * c


def mla_linear(cfg: dict[str, Any]) -> int:
    """Multi-head latent attention's Linear weights: q (or q_a and q_b), kv_a, kv_b and o."""
    c, h, r_q, r_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    d_n, d_r, d_v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q = c * h * (d_n + d_r) if r_q is None else c * r_q + r_q * h * (d_n + d_r)
    return q + c * (r_kv + d_r) + r_kv * h * (d_n + d_v) + h * d_v * c


def decoder_linear(cfg: dict[str, Any], attention: int) -> list[int]:
    """Per pipeline layer, a decoder's Linear weights: none in the embedding; per block its attention's and
    its MLP's (a dense SwiGLU's 3 C I; an MoE block's shared experts only: the router and the stacked experts
    are not Linear modules); the head's lm_head, and per MTP depth its eh_proj (2C x C), a block like the last
    and its shared head's own Linear over the lm_head's weight (a module of its own: autocast copies it again)."""
    c, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    moe = moe_config(cfg)
    blocks = [attention + (shared if moe is not None and moe.is_moe(b) else 3 * c * i)
              for b, (_, shared) in enumerate(experts_active(cfg))]
    depth = (cfg.get("mtp") or {}).get("depth", 0)
    return [0, *blocks, v * c + depth * (2 * c * c + blocks[-1] + v * c)]


def linear_weights(m: ModelConfig) -> list[int]:
    """Per pipeline layer, the weights of its Linear modules (what autocast copies)."""
    cfg = m.resolved_knobs()
    if m.family == "gpt2":
        c = cfg["n_embd"]
        return [0, *[12 * c * c] * cfg["n_layer"], cfg["vocab_size"] * c]
    if m.family == "mlp":
        widths = [cfg["d_in"], *[cfg["d_hidden"]] * (cfg["n_layer"] - 1), cfg["d_out"]]
        return [a * b for a, b in zip(widths, widths[1:])]
    if m.family in ("llama", "deepseek"):
        return decoder_linear(cfg, gqa_linear(cfg) if m.family == "llama" else mla_linear(cfg))
    return [0] * m.num_layers


def autocast_copy_bytes(m: ModelConfig, *, precision: str) -> list[float]:
    """Per layer, the bytes of the compute-dtype copies autocast makes of its Linear weights in one forward
    (models/profile.py autocast_weight_bytes measures them); 0 under fp32."""
    return [float(COPY_BYTES[precision] * w) for w in linear_weights(m)]


def loss_bytes_per_token(m: ModelConfig, *, seq: int) -> float:
    """The bytes the loss saves for its backward per token (models/profile.py loss_saved_bytes_per_token
    measures them over min(seq, 8) tokens, in fp32 under bf16 autocast too): a causal LM's cross-entropy keeps
    the log-softmax (4 V) and the int64 targets (8), and one fp32 scalar per microbatch; the MLP's MSE its
    input and target (2 x 4 d_out); model=sleep none."""
    cfg = m.resolved_knobs()
    if m.family == "mlp":
        return 8.0 * cfg["d_out"]
    if m.family == "sleep":
        return 0.0
    return 4.0 * cfg["vocab_size"] + 8.0 + 4.0 / min(seq, 8)


def tied_layers(m: ModelConfig) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Per weight that several pipeline layers share, those layers and its size: the embedding with the head
    (GPT-2 always; a decoder with tie_word_embeddings, or with MTP depths, which read the embedding)."""
    cfg = m.resolved_knobs()
    if m.family == "gpt2":
        return (((0, cfg["n_layer"] + 1), cfg["vocab_size"] * cfg["n_embd"]),)
    if m.family in ("llama", "deepseek") and (cfg["tie_word_embeddings"] or (cfg.get("mtp") or {}).get("depth", 0)):
        return (((0, cfg["num_hidden_layers"] + 1), cfg["vocab_size"] * cfg["hidden_size"]),)
    return ()
