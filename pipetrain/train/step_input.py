"""What a training step reads, and what of the data a checkpoint keeps.

`StepInput.read(step, split)` draws the global batch of `step` (train/data.py's DataSource), counts
what the data/ metrics report and the loss tokens the step's loss is averaged over (before the
batch is cut for this rank: runtime/step_loss.py), and cuts this rank's microbatches and, under
context parallel with document masks, their documents from the whole rows (parallel/parallelize.py).
A data source declares what more it offers (`Counted`: the data/ metrics of its last batch, counted
as it assembled it; `Positioned`: a stream's position, data.streaming) and is read with isinstance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from pipetrain.metrics.names import data_metrics
from pipetrain.models.causal_lm import IGNORE_INDEX
from pipetrain.parallel.parallelize import Parallelize
from pipetrain.runtime.batch import Batch
from pipetrain.runtime.documents import Documents
from pipetrain.runtime.step_loss import GlobalTokens
from pipetrain.train.data import DataSource, split_microbatches


@runtime_checkable
class Counted(Protocol):
    last_stats: dict[str, float]  # the data/ metrics of the last training batch (padding, tokens per source)


@runtime_checkable
class Positioned(Protocol):
    """A stateful source (train/hf_stream.py): its position after the last step read, and back to one."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepInput:
    data: Optional[DataSource]  # None: a Trainer without training data (mode=eval reads its own)
    parallel: Parallelize
    microbatches: int  # pipeline.microbatches
    eos: Callable[[], Optional[int]]  # the id that ends a document where masks are on (the executor's batch)
    stats: dict[str, float] = field(default_factory=dict)  # the data/ metrics of the last training batch
    tokens: Optional[GlobalTokens] = None  # its loss tokens, where its microbatches count unequal ones

    def read(self, step: int, split: str = "train") -> tuple[list[Batch], Optional[list[Documents]]]:
        """This rank's microbatches of `step` (its 1/dp rows, under cp its positions, split in M) and, under
        context parallel with document masks, their documents (None: the executor computes them)."""
        assert self.data is not None, "this Trainer was built with train_data=False (mode=eval)"
        batch = self.data.batch(step, split=split)
        if split == "train":
            x, y = batch  # token ids, or (mlp, sleep) a model's own example inputs: no tokens to count
            self.stats = self.data.last_stats if isinstance(self.data, Counted) and self.data.last_stats else (
                data_metrics(tokens=x.numel(), loss_tokens=int((y != IGNORE_INDEX).sum()), positions=x.numel())
                if not x.is_floating_point() else {})
            self.tokens = self.parallel.global_tokens(batch, self.microbatches)
        rows, M = self.parallel.local_batch(batch), self.microbatches
        return split_microbatches(rows, M), self.parallel.local_documents(batch, self.eos(), M)

    def position(self) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of the data: a stream's position (None: a batch is a function of its step)."""
        return self.data.state_dict() if isinstance(self.data, Positioned) else None

    def restore(self, state: Optional[dict[str, Any]], step: int, note: Callable[[str], None]) -> None:
        """A stream back to the resumed step's position: the checkpoint's, or where it has none (saved
        without streaming) by reading the steps before it."""
        if not isinstance(self.data, Positioned) or step == 0:
            return
        if state is not None:
            self.data.load_state_dict(state)
            return
        note(f"data: the checkpoint holds no stream position (saved without data.streaming): reading the "
             f"{step} steps before it again to find it")
        for k in range(step):
            self.data.batch(k)
