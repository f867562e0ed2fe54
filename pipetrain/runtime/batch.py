"""A step's microbatches as the executor reads them: on the device, and counted.

Inputs and targets move to the device once per step, before the step's first action, from
pinned memory and without blocking. A host-to-device copy from pageable memory synchronises
the stream: inside the step (at every first-stage forward, at every loss) the host would wait
for all the compute queued before it, emptying the GPU's queue each time. Only a few KB move;
the cost was the wait, not the bytes. Under document masks each microbatch's documents
(runtime/documents.py) are computed from its inputs on the host and move with them.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import torch

from pipetrain.runtime.documents import Documents, documents

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) each: a batch or a microbatch
Docs = Optional[Sequence[Documents]]  # a step's documents per microbatch, where the caller cut them (StepBatch.load)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: to a GPU from pinned memory, non-blocking (the stream goes on; the
    caching host allocator keeps the pinned copy until the transfer is done); on the CPU the
    tensor itself (no copy)."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def counted_targets(target: torch.Tensor) -> int:
    """Targets a microbatch's loss averages over: token ids other than -1 (the loss's
    ignore_index); a regression target (floats) counts as one."""
    return 1 if target.is_floating_point() else int((target != -1).sum())


class StepBatch:
    """A step's microbatches as a rank's executor reads them: the inputs its chains' first stages take and
    the targets its last stages' losses read (their inputs too where `loss_inputs`), on the device; with
    `document_eos` set (data.document_mask: the id that ends a document) every microbatch's Documents, which
    every stage forward of it reads."""

    def __init__(self, device: torch.device, *, loss_inputs: bool = False) -> None:
        self.device = device
        self.document_eos: Optional[int] = None
        self.loss_inputs = loss_inputs  # a last stage's loss reads its microbatches' inputs (multi-token prediction)
        self.load([], (), ())

    def load(self, microbatches: Sequence[Batch], inputs: Iterable[int], targets: Iterable[int],
             docs: Docs = None) -> None:
        """This step's: `microbatches[m]` is (input, target) of microbatch m; `inputs` / `targets` the m read;
        `docs[m]` microbatch m's documents where the caller cut them from whole rows (context parallel:
        parallel/parallelize.py local_documents), else computed here from the inputs."""
        self.given = microbatches  # as given (evaluate() counts targets on the host)
        self.inputs = {m: to_device(microbatches[m][0], self.device) for m in sorted(inputs)}
        self.targets = {m: to_device(microbatches[m][1], self.device) for m in sorted(targets)}
        # the inputs a last stage's loss reads (multi-token prediction: the tokens ahead), one copy per microbatch
        self.loss_input = {m: self.inputs[m] if m in self.inputs else to_device(microbatches[m][0], self.device)
                           for m in self.targets} if self.loss_inputs else {}
        eos = self.document_eos
        if docs is None:
            docs = [] if eos is None else [documents(x, eos) for x, _ in microbatches]
        self.docs: dict[int, Documents] = {m: self._moved(d) for m, d in enumerate(docs)}

    def _moved(self, d: Documents) -> Documents:
        """Every tensor of `d` on the device (index, positions; under context parallel keys and causal too)."""
        return Documents(*(None if t is None else to_device(t, self.device)
                           for t in (getattr(d, f.name) for f in dataclasses.fields(d))))
