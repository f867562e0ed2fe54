"""pipetrain/compat.py's version-dependent readers handle both layouts: FSDP2's state holds a list of
parameter groups in torch 2.13 and one group in 2.11 (where the H200 check's FSDP2 test failed on the
newer attribute name). That private torch, OmegaConf and Hydra APIs are reached only through compat.py
and compat_hydra.py is checked in tests/test_one_home.py."""

from types import SimpleNamespace

import pytest

from pipetrain.compat import fsdp_state_param_groups

pytestmark = pytest.mark.pure


def test_param_groups_of_both_state_layouts():
    a, b = object(), object()
    assert fsdp_state_param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert fsdp_state_param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert fsdp_state_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_param_groups_of_this_torch():
    """The name this torch's FSDP2 uses is one fsdp_state_param_groups reads."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    state = FSDPState()
    assert hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group")
    assert fsdp_state_param_groups(state) == []
