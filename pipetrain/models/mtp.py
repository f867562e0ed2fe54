"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2; config/mtp.py): D modules after the main
model, depth k predicting the token k + 1 ahead of each position, the causal chain kept across depths.

Depth k (k = 1..D) at position i, for the positions 0..T-k-1 a row of T tokens leaves it:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])       (B, T-k, 2C) -> (B, T-k, C)
    h^k  = block(h')                                              one transformer block of the model's kind
    P^k  = shared_head(h^k) = head(norm(h^k))                     (B, T-k, V), target t_{i+k+1}

h^0 is the main model's last hidden state before its final norm (the head layer's input; hnorm normalizes
it, as each depth's own output is normalized by its `shared_head.norm` before the shared `head`). The
concatenation puts the embedding first, as Megatron-LM's and vLLM's DeepSeek MTP layers do (the paper
writes the hidden state first; the order only permutes eh_proj's columns, and this one matches the weights
DeepSeek published). `embed_tokens` and `shared_head.head` are the main model's embedding and lm_head (one
Parameter each: split.py keeps the copies on other stages equal through runtime/sync.py, as a tied head's);
`enorm`, `hnorm`, `eh_proj`, the block and `shared_head.norm` are each depth's own. Parameter names under
the head layer, `mtp.{k-1}.{enorm, hnorm, eh_proj, block.*, shared_head.norm, shared_head.head,
embed_tokens}`, are Hugging Face deepseek_v3's MTP layer keys (`model.layers.{N+k-1}.*`, the block's
keys without `block.`).

Where it runs: inside the head layer (the model's last pipeline layer), so on the last stage wherever the
placement puts it: after the last stage's blocks under loop placements, on rank 0 beside the embedding
under V placements (zbv, dualpipev), as DeepSeek-V3 places it. A head with MTP (`WithMTP`) returns its
logits with its input beside them, (B, T, V + C), and computes the objective as the stage's loss
(parallel/layer_spec.py LossPlanned), reading the microbatch's token ids (the executor hands them to the
loss of a stage that asks: runtime/stage_protocol.py). The loss is a (1 + D,) vector: [0] the main
cross-entropy, carrying the gradient of L_main + (lambda / D) sum_k L_k (its value is L_main's alone, so
train/loss stays comparable with a run without MTP and mode=eval's loss leaves MTP out), [k] L_k detached,
reported as `mtp/loss_k` (runtime/step_loss.py averages them as the loss).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.config.mtp import MTPConfig
from pipetrain.models.causal_lm import IGNORE_INDEX
from pipetrain.models.init import embedding
from pipetrain.parallel.layer_spec import ExpertsPlanned


class SharedHead(nn.Module):
    """A depth's output head: its own final norm, then the main model's lm_head (one Parameter)."""

    def __init__(self, norm: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))  # (B, t, C) -> (B, t, V)


class MTPDepth(nn.Module):
    """One MTP module (module docstring): `make_norm()` builds one of the model's norms (width C)."""

    def __init__(self, *, hidden: int, make_norm: Callable[[], nn.Module], block: nn.Module,
                 embed: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.embed_tokens = embedding(embed.num_embeddings, embed.embedding_dim)
        self.embed_tokens.weight = embed.weight  # the main model's embedding
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        head = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False, device=lm_head.weight.device)
        head.weight = lm_head.weight  # the main model's lm_head
        self.shared_head = SharedHead(make_norm(), head)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h (B, t, C): the previous depth's hidden states at positions 0..t-1; ids (B, t): the tokens k ahead."""
        e = self.enorm(self.embed_tokens(ids))  # (B, t, C)
        return self.block(self.eh_proj(torch.cat([e, self.hnorm(h)], dim=-1)))  # (B, t, 2C) -> (B, t, C)


class MTP(nn.ModuleList):
    """The D depths, and the objective they add (module docstring)."""

    def __init__(self, depths: list[MTPDepth], *, loss_weight: float) -> None:
        super().__init__(depths)
        self.loss_weight = loss_weight

    def loss(self, output: torch.Tensor, target: torch.Tensor, ids: torch.Tensor,
             main_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """(1 + D,): [main (with the MTP gradient), L_1, ..., L_D] from the head's (B, T, V + C) output, the
        targets (B, T) and the input ids (B, T); `main_loss` is the model's own loss of (logits, target)."""
        width = self[0].eh_proj.out_features
        logits, h = output[..., :-width], output[..., -width:]  # (B, T, V), (B, T, C)
        main = main_loss(logits, target)
        t, parts = h.size(1), []
        for k, depth in enumerate(self, start=1):
            h = depth(h[:, : t - k], ids[:, k:])  # (B, T-k, C): positions 0..T-k-1, the tokens k ahead
            parts.append(token_mean_cross_entropy(depth.shared_head(h), target[:, k:]))
        extra = self.loss_weight / len(self) * torch.stack(parts).sum()
        # value L_main exactly (x + 0.0), gradient that of L_main + extra
        return torch.stack([main + (extra - extra.detach()), *(p.detach() for p in parts)])


def token_mean_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the counted targets (0, not NaN, where a depth has none left: a row whose
    last targets alone were counted)."""
    v = logits.size(-1)
    total = F.cross_entropy(logits.reshape(-1, v), target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (target != IGNORE_INDEX).sum().clamp(min=1)


class WithMTP:
    """Mixed into a model family's head class before it (`class MTPHead(WithMTP, Head)`): the head's
    forward with its input beside the logits, and the objective as the stage's loss. The head class
    sets `self.mtp` (an MTP) and `self.main_loss` (the model's loss_fn) in its constructor."""

    mtp: MTP
    main_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lm_head: nn.Linear

    def attach(self, mtp: MTPConfig, *, hidden: int, make_norm: Callable[[], nn.Module], embed: nn.Embedding,
               make_block: Callable[[], nn.Module], main_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> None:
        """Build the `mtp.depth` depths on this head (after any tie of its lm_head to the embedding):
        `make_norm()` one of the model's norms of width `hidden`, `make_block()` one of its blocks."""
        self.mtp = MTP([MTPDepth(hidden=hidden, make_norm=make_norm, block=make_block(), embed=embed,
                                 lm_head=self.lm_head) for _ in range(mtp.depth)], loss_weight=mtp.loss_weight)
        self.main_loss = main_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super().forward(x), x], dim=-1)  # type: ignore[misc]  # (B, T, V + C)

    def loss_reads_inputs(self) -> bool:
        return True

    def ep_plan(self) -> tuple[str, ...]:
        """The depths' blocks' stacked experts (parallel/ep.py): split over the EP group like every MoE block's."""
        return tuple(f"mtp.{j}.block.{path}" for j, depth in enumerate(self.mtp)
                     if isinstance(depth.block, ExpertsPlanned) for path in depth.block.ep_plan())

    def layer_loss(self, output: torch.Tensor, target: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        return self.mtp.loss(output, target, inputs, self.main_loss)


# ---- names and costs (pure arithmetic) ------------------------------------------------------------


def mtp_hf_key(rest: str, *, num_hidden_layers: int) -> str:
    """The head layer's `mtp.{j}.{rest}` -> Hugging Face deepseek_v3's key of MTP layer j: `model.layers.{N + j}.`
    with the block's keys unprefixed (`block.self_attn.q_proj.weight` -> `self_attn.q_proj.weight`)."""
    j, _, key = rest[len("mtp."):].partition(".")
    return f"model.layers.{num_hidden_layers + int(j)}.{key.removeprefix('block.')}"


def mtp_name(key: str, *, num_hidden_layers: int, depth: int) -> str | None:
    """The inverse of `mtp_hf_key` as the head layer's `mtp.{j}.{rest}` (None: not an MTP key of this depth)."""
    parts = key.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    j = int(parts[2]) - num_hidden_layers
    if not 0 <= j < depth:
        return None
    own = parts[3].split(".")[0] in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
    return f"mtp.{j}.{parts[3] if own else 'block.' + parts[3]}"
