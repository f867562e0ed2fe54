"""Packed rows as documents, for attention that stays inside each document (issue #46).

data=datasets packs documents into rows as `[BOS] ids EOS` each (train/hf_data.py), so a row's token
ids alone say where its documents start: at position 0 and right after every EOS (a row may begin
mid-document: that part is a document of its own here). `documents(ids, eos)` turns a microbatch's
ids into `Documents`: per position its document's index in the row and its position within that
document. A query attends a key of its own document at or before it (block-causal), and positions
restart at 0 per document (RoPE tables, GPT-2's wpe are indexed by them), so every document of a
packed row computes what it would alone.

The executor (runtime/executor.py) computes one `Documents` per microbatch on the host once per step
(every rank holds the step's microbatches, not only the first stage's), moves it to the device with
the inputs (runtime/batch.py StepBatch), and hands it to every stage forward of that microbatch
(runtime/stage_protocol.py Stage: `stage(x, docs)`). A stage builds the (B, 1, T, T) mask once per
forward (`with_mask`), not per layer; its layers that declare parallel/layer_spec.py DocumentsPlanned
read it. Without document masks nothing of this runs: SDPA's is_causal path, bit for bit as before.

Under context parallel a rank holds some positions of each row (parallel/cp.py: load-balanced chunks), and
the row's documents are computed from the whole row (every rank has the step's full microbatches) and cut
the way its positions are (`ContextAttention.local_documents`): `index` and `positions` at this rank's
positions (the queries), `keys` the document of every position in the order the cp group gathers K/V, and
`causal` which of those keys come at or before each query. The mask is then (B, 1, T/cp, T).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Documents:
    """The documents of one microbatch's rows."""

    index: torch.Tensor  # (B, T) int64: 0 at position 0, +1 at each position right after an EOS
    positions: torch.Tensor  # (B, T) int64: the position within its document, 0 where one starts
    mask: Optional[torch.Tensor] = None  # (B, 1, T, T) bool: query i may attend key j (with_mask)
    # context parallel (parallel/cp.py), None without: the document of each key (B, T_row) in the cp group's
    # gathered order, and (T, T_row) bool: key j's position in the row at or before query i's
    keys: Optional[torch.Tensor] = None
    causal: Optional[torch.Tensor] = None

    def with_mask(self) -> Documents:
        """These documents with their attention mask built (once per stage forward, shared by its layers)."""
        return self if self.mask is not None else dataclasses.replace(self, mask=self.attention_mask())

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool for scaled_dot_product_attention's attn_mask (broadcast over heads); under
        context parallel (B, 1, T/cp, T_row): this rank's queries, the keys in gathered order."""
        if self.mask is not None:
            return self.mask
        if self.keys is None or self.causal is None:
            return block_causal(self.index)
        return (self.index[:, None, :, None] == self.keys[:, None, None, :]) & self.causal  # (B, 1, T/cp, T_row)

    def rows(self, start: int, stop: int) -> Documents:
        """Rows start..stop of these documents (a microbatch's, as train/data.py split_microbatches cuts)."""
        cut = [None if t is None else t[start:stop] for t in (self.index, self.positions, self.mask, self.keys)]
        return Documents(*cut, causal=self.causal)


def documents(ids: torch.Tensor, eos: int) -> Documents:
    """The documents of token ids (B, T): one starts at position 0 and right after every EOS (a BOS,
    where the data writes one, follows an EOS, so it opens its document; an EOS ends its own)."""
    if ids.dim() != 2 or ids.is_floating_point():
        raise ValueError(f"document masks read token ids (B, T), got a {tuple(ids.shape)} {ids.dtype} tensor")
    b, t = ids.shape
    starts = torch.zeros((b, t), dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, :-1] == eos  # (B, T): a document starts right after an EOS
    index = starts.long().cumsum(1)  # (B, T)
    arange = torch.arange(t, device=ids.device).expand(b, t)  # (B, T)
    first = torch.where(starts, arange, 0).cummax(1).values  # (B, T): where each position's document starts
    return Documents(index, arange - first)


def block_causal(index: torch.Tensor) -> torch.Tensor:
    """(B, T) document indices -> (B, 1, T, T) bool: key j <= query i, both of one document."""
    t = index.size(1)
    causal = torch.ones((t, t), dtype=torch.bool, device=index.device).tril()  # (T, T)
    return (index[:, None, :, None] == index[:, None, None, :]) & causal  # (B, 1, T, T)

