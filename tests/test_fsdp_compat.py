"""FSDP2's private state across torch versions: the executor's explicit reduce reaches every
parameter group whether the state holds a list (torch 2.13) or one group (torch 2.11, where the
H200 check's FSDP2 test failed on the newer attribute name)."""

from types import SimpleNamespace

import pytest

from pipetrain.parallel.fsdp import _param_groups

pytestmark = pytest.mark.pure


def test_param_groups_of_both_state_layouts():
    a, b = object(), object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_param_groups_of_this_torch():
    """The name this torch's FSDP2 uses is one _param_groups reads."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    state = FSDPState()
    assert hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group")
    assert _param_groups(state) == []
