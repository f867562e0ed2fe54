"""What DCP needs to write and read a rank's parts of an unsplit tensor (parallel/split_weights.py
LocalParts: a tp or ep slice, or an FSDP2 shard of one, as boxes of the unsplit tensor): its default
planners, which look a state dict's objects up by `isinstance(torch.Tensor)` (DTensor's own chunk hooks
do the rest), taught to find a box by its offsets, and to keep LocalParts through the load's set-up.
train/checkpoint.py and train/checkpoint_async.py hand these planners to dcp.save, dcp.async_save and
dcp.load.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def is_parts(obj: Any) -> bool:
    """A rank's parts of an unsplit tensor (parallel/split_weights.py LocalParts): not a tensor, but it
    speaks DCP's chunk protocol (the one DTensor implements)."""
    return not isinstance(obj, torch.Tensor) and hasattr(obj, "__get_tensor_shard__")


@functools.cache
def planners() -> tuple[type, type]:
    """DCP's default save and load planners, which also find a box of a LocalParts by its offsets
    (DCP looks objects up by isinstance(torch.Tensor); DTensor's own hooks do the rest) and keep
    LocalParts through the load's set-up (which would replace what it does not know by None).
    The state dicts are flat (train/checkpoint.py's keys), so a key is its flattened key."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    def find(planner: Any, index: Any, default: Any) -> Any:
        obj = planner.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if is_parts(obj) else default(index)

    class SavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            return find(self, index, super().lookup_object)

    class LoadPlanner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            parts = {k: v for k, v in state_dict.items() if is_parts(v)}
            super().set_up_planner(state_dict, *args, **kwargs)
            state_dict.update(parts)
            self.state_dict.update(parts)

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return find(self, index, super().lookup_tensor)

    return SavePlanner, LoadPlanner
