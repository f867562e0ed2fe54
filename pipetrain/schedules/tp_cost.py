"""What tensor parallel does to one layer's cost: compute divided by tp, TP collectives added.

Megatron-LM's tensor parallel (Shoeybi et al. 2019, section 3) splits every matmul of a layer
evenly over tp ranks, so a layer's F, B and W times divide by tp; what it adds is communication
on the critical path (not overlapped with compute), per layer and microbatch of N tokens, hidden
size C, V the vocabulary, s bytes per value:

  block      F: 2 all-reduces of N x C (after attention and after the MLP)
             B: 2 all-reduces of N x C (the input gradients of the column-parallel regions)
  embedding  F: 1 all-reduce of N x C (vocab-parallel lookup)
  head       F: 2 all-reduces of fp32 values per token, 1 and 2 (the vocab-parallel loss:
                the row max; the sum of exp with the target's logit);  B: 1 all-reduce of N x C
                (the loss's backward is local: parallel/loss_parallel.py)
  W          none (weight gradients are local)

Sequence parallel (Korthikanti et al. 2022) replaces each all-reduce by a reduce-scatter plus an
all-gather: the same ring bytes, 2(tp-1)/tp x S per all-reduce and (tp-1)/tp x S per all-gather
(schedules/reduce_cost.py: ring_factor), over `cluster.tp_bandwidth_gbs`, plus `latency_ms` per
collective (0 unless the planner calibrated it: gloo on CPU pays about a millisecond each).
Parameters stored per rank divide by tp (norms and position embeddings, replicated, are rounded in), an MoE
layer's experts by etp (expert tensor parallel: tp, or 1 where they stay whole and ep takes the tp ranks: the
expert GEMMs per rank are 1/tp all the same, 1/tp of the tokens' rows at full width); an MoE layer's
all-to-all (comm_f_ms / comm_b_ms, partition/costs.py ep_layer_costs) is not divided: a rank sends the tokens
it dispatches at their full width;
activation bytes divide by tp under sequence parallel (every saved activation is split), and are
left whole without it (conservative: the split attention and MLP activations are most of them, the
replicated norms' inputs are not). The loss's logits are apart from the layers (planner/memory.py:
loss_rank_bytes): vocab-parallel, each tp rank keeps V/tp of them.

Layers are told apart by name: "embed" and "head" (GPT-2 and Llama), every other layer is a block
(the sleep model's layers too). Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from pipetrain.partition.costs import LayerCost
from pipetrain.schedules.reduce_cost import ring_factor


def comm_ms(nbytes: float, bandwidth_gbs: float) -> float:
    return nbytes / (bandwidth_gbs * 1e9) * 1e3


LOSS_VALUES = 3  # fp32 values per token the vocab-parallel loss all-reduces: max; sum of exp, target logit


def collectives(name: str) -> tuple[int, int]:
    """(in F, in B) TP collectives of a layer named `name`, as the table above lists them."""
    return {"embed": (1, 0), "head": (2, 1)}.get(name, (2, 2))


def tp_layer_costs(layers: Sequence[LayerCost], *, tp: int, tokens: int, hidden: int, bytes_per_value: int,
                   bandwidth_gbs: float, sequence_parallel: bool = False, latency_ms: float = 0.0,
                   vocab: int = 0, etp: Optional[int] = None) -> list[LayerCost]:
    """Per-layer costs of one tp rank for one microbatch of `tokens` tokens; `etp` (None: tp) splits the experts.
    `vocab` is not used (the head's collectives no longer carry (N, V) logits); callers may stop passing it."""
    if tp < 1:
        raise ValueError(f"parallel.tp must be >= 1 (got {tp})")
    if tp == 1:
        return list(layers)
    if not bandwidth_gbs > 0:
        raise ValueError(f"cluster.tp_bandwidth_gbs must be > 0 GB/s (got {bandwidth_gbs})")
    act = tokens * hidden * bytes_per_value  # one (N, C) activation
    all_reduce = latency_ms + comm_ms(ring_factor(tp, all_reduce=True) * act, bandwidth_gbs)
    # the loss's all-reduces: N fp32 values, then 2N; latency-bound (a few KB) where the gathered
    # logits they replace were N x V values (2.1 GB per 4,096 tokens at Llama 3's 128,256 vocabulary)
    loss = 2 * latency_ms + comm_ms(ring_factor(tp, all_reduce=True) * tokens * LOSS_VALUES * 4, bandwidth_gbs)
    etp = tp if etp is None else etp
    out = []
    for layer in layers:
        n_f, n_b = collectives(layer.name)
        experts = -(-layer.experts_params // etp)
        extra_f, extra_b = (loss if layer.name == "head" else n_f * all_reduce), n_b * all_reduce
        out.append(dataclasses.replace(
            layer, f_ms=(layer.f_ms - layer.comm_f_ms) / tp + layer.comm_f_ms + extra_f,
            b_ms=(layer.b_ms - layer.comm_b_ms) / tp + layer.comm_b_ms + extra_b, w_ms=layer.w_ms / tp,
            params=-(-(layer.params - layer.experts_params) // tp) + experts, experts_params=experts,
            flops_per_token=layer.flops_per_token / tp,
            activation_bytes_per_token=(-(-layer.activation_bytes_per_token // tp) if sequence_parallel
                                        else layer.activation_bytes_per_token)))
    return out


def tp_rank_layers(layers: Sequence[LayerCost], *, tp: int, sequence_parallel: bool, tokens: int, hidden: int,
                   vocab: int, value_bytes: int, bandwidth_gbs: float,
                   replicated_bytes_per_token: float = 0.0, latency_ms: float = 0.0,
                   etp: Optional[int] = None) -> list[LayerCost]:
    """One tp rank's layers (tp_layer_costs: compute / tp plus the TP collectives, parameters / tp).
    Activations: / tp under sequence parallel; without it a block keeps its replicated part
    (`replicated_bytes_per_token`, the norms') whole and splits the rest (Korthikanti et al. 2022:
    sbh (10 + 24 / t) for their 34); 0 leaves the blocks' activations whole (tp_cost's bound)."""
    split = tp_layer_costs(layers, tp=tp, tokens=tokens, hidden=hidden, vocab=vocab, bytes_per_value=value_bytes,
                           bandwidth_gbs=bandwidth_gbs, sequence_parallel=sequence_parallel, latency_ms=latency_ms,
                           etp=etp)
    if tp == 1 or sequence_parallel or not replicated_bytes_per_token:
        return split
    return [dataclasses.replace(l, activation_bytes_per_token=replicated_bytes_per_token
                                + (l.activation_bytes_per_token - replicated_bytes_per_token) / tp)
            if l.name not in ("embed", "head") and l.activation_bytes_per_token > replicated_bytes_per_token else l
            for l in split]
