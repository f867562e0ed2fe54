"""GPT-2's sizes and costs: parameters per pipeline layer and each layer's LayerCost (FLOPs, activation bytes,
the GEMM shapes a device times), pure arithmetic over the model's knobs (models/gpt2.py builds the layers)."""

from __future__ import annotations

from typing import Any

from pipetrain.models.decoder_costs import layer_cost
from pipetrain.partition.costs import COLUMN, ROW, LayerCost, LayerShape


def gpt2_layer_params(*, n_layer: int, n_embd: int, vocab_size: int, block_size: int, bias: bool = True,
                      **_: Any) -> list[int]:
    """Parameters each layer stores, computed from the config (no allocation).

    The head counts its tied copy of wte (V*C): that is what it stores when it sits on
    another stage than the embedding. So sum(...) = total + V*C; see gpt2_param_count.
    """
    c, b = n_embd, int(bias)
    norm = c * (1 + b)  # LayerNorm weight (+ bias)
    block = 12 * c * c + 9 * b * c + 2 * norm  # c_attn 3C^2, c_proj C^2, c_fc 4C^2, mlp.c_proj 4C^2
    return [vocab_size * c + block_size * c, *[block] * n_layer, norm + vocab_size * c]


def gpt2_param_count(**config: Any) -> int:
    """Distinct parameters of the unsplit model (wte counted once, wpe included)."""
    return sum(gpt2_layer_params(**config)) - config["vocab_size"] * config["n_embd"]


def gpt2_layer_costs(
    *, n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int, dropout: float = 0.0,
    bias: bool = True, microbatch: int, seq: int, tflops: float, bytes_per_value: int = 4,
) -> list[LayerCost]:
    """Analytic per-layer costs for one microbatch of `microbatch` x `seq` tokens.

    FLOPs per token (the nanoGPT / PaLM appendix B estimate): forward = 2 FLOPs per parameter
    that multiplies the token (biases and norms rounded in), plus attention's two matmuls
    QK^T and AV, 2 * 2 * T * C per layer. The embedding is a lookup (0 FLOPs; its wte is
    counted at the head, whose matmul uses it). Backward: input-grad (B) and weight-grad (W)
    each cost the forward's 2 * params; attention's matmuls have no weights, so their
    backward (2x their forward) is all B. Summed over layers, F + B + W = 6 N + 12 L C T,
    nanoGPT's estimate_mfu with N = non-embedding params. Times are FLOPs at `tflops`.

    Activation bytes per token kept for backward (fp32: bytes_per_value 4): a block keeps
    17 C values (ln_1 in, c_attn in, q/k/v, attention out, c_proj in, ln_2 in, c_fc in,
    GELU in 4C, mlp.c_proj in 4C; SDPA keeps no T x T scores); the embedding keeps the
    int64 indices; the head keeps ln_f and lm_head inputs plus the log-softmax of the
    logits (V values) and the int64 targets. With dropout, each dropout adds a 1-byte mask
    per value (attention-probability dropout inside SDPA is not counted).
    """
    c, t, v, tokens = n_embd, seq, vocab_size, microbatch * seq
    params = gpt2_layer_params(n_layer=n_layer, n_embd=c, vocab_size=v, block_size=block_size, bias=bias)
    mask = 1 if dropout > 0 else 0
    attn = 2 * 2 * t * c

    def cost(name: str, stored: int, matmul: int, attn_f: int, act: int, shape: LayerShape) -> LayerCost:
        return layer_cost(name, stored=stored, matmul=matmul, attn_f=attn_f, act=act, tokens=tokens, tflops=tflops,
                          shape=shape)

    # shapes for a device's timing: c_attn, attn c_proj, c_fc, mlp c_proj; GELU's 4C in and out split by tp, the two
    # LayerNorms (2C each) and bias-dropout-residual adds (3C each) whole; the head's loss reads and writes ~4V
    block = LayerShape(((c, 3 * c, COLUMN), (c, c, ROW), (c, 4 * c, COLUMN), (4 * c, c, ROW)), n_head, n_head,
                       c // n_head, elementwise_values=8 * c, elementwise_whole=10 * c)
    out = [cost("embed", params[0], 0, 0, 8 + mask * c, LayerShape(elementwise_whole=5 * c))]
    block_act = 17 * c * bytes_per_value + mask * 2 * c
    out += [cost(f"h.{i}", params[1 + i], params[1 + i], attn, block_act, block) for i in range(n_layer)]
    out.append(cost("head", params[-1], params[-1], 0, (2 * c + v) * bytes_per_value + 8,
                    LayerShape(((c, v, COLUMN),), elementwise_values=4 * v, elementwise_whole=2 * c)))
    return out
