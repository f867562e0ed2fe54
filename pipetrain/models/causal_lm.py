"""What every decoder-only language model here shares: token ids in, logits out, the same
pipeline-layer shape, loss, boundary specs and the cost arithmetic of one layer.

Layers: 0 = embedding (ids (B, T) int64 -> (B, T, C)), 1..n = blocks ((B, T, C) -> (B, T, C)),
n + 1 = head ((B, T, C) -> logits (B, T, V)); the loss (cross-entropy) is computed where the
head lives. GPT-2 (gpt2.py) and the Llama family (llama.py) subclass `CausalLM`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pipetrain.models.base import LayeredModel, TensorSpec


IGNORE_INDEX = -1  # a target that counts in no loss (runtime/batch.py: counted_targets)


class CausalLM(LayeredModel):
    """Subclasses call `_set_shape` in `__init__`, then fill `layers` and `layer_names`."""

    _width: int  # C, the hidden size crossing every block boundary
    _vocab: int  # V
    _blocks: int  # transformer blocks (pipeline layers minus embedding and head)
    _max_seq: int  # longest sequence the model takes
    _max_seq_knob: str  # the knob that sets it, for error messages

    def _set_shape(self, *, width: int, vocab: int, blocks: int, max_seq: int, max_seq_knob: str) -> None:
        self._width, self._vocab, self._blocks = width, vocab, blocks
        self._max_seq, self._max_seq_knob = max_seq, max_seq_knob

    @staticmethod
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Mean cross-entropy over the counted tokens of the microbatch (IGNORE_INDEX marks the others).
        # Under tensor parallel the last stage's loss is parallel/loss_parallel.py's instead, on (B, T, V/tp).
        v = output.size(-1)
        return F.cross_entropy(output.view(-1, v), target.view(-1), ignore_index=IGNORE_INDEX)  # (B*T, V) vs (B*T,)

    @property
    def loss_parts(self) -> int:
        """The parts each microbatch's loss reports beside it: multi-token prediction's depths (models/mtp.py)."""
        return (self._config.get("mtp") or {}).get("depth", 0)

    def _seq(self, seq: int) -> int:
        if not 1 <= seq <= self._max_seq:
            raise ValueError(f"seq={seq} must be in 1..model.{self._max_seq_knob}={self._max_seq}")
        return seq

    def boundary_specs(self, *, microbatch: int, seq: int) -> list[TensorSpec]:
        t = self._seq(seq)
        hidden = TensorSpec((microbatch, t, self._width), self.param_dtype)
        return [TensorSpec((microbatch, t), torch.long), *[hidden] * (self._blocks + 1),
                TensorSpec((microbatch, t, self._vocab), self.param_dtype)]

    def target_spec(self, *, microbatch: int, seq: int) -> TensorSpec:
        return TensorSpec((microbatch, self._seq(seq)), torch.long)

    def example_batch(
        self, *, microbatch: int, seq: int, generator: torch.Generator | None = None, device: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (microbatch, self._seq(seq))
        idx = torch.randint(0, self._vocab, shape, generator=generator).to(device)
        return idx, torch.randint(0, self._vocab, shape, generator=generator).to(device)
