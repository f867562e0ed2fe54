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


def test_to_empty_makes_what_module_to_empty_makes_without_sympy():
    """compat.to_empty leaves the shapes, strides, dtypes, devices and Parameter ties that nn.Module.to_empty
    leaves, and in a fresh process imports no sympy (torch's meta empty_like does: 0.3-0.6 s in every rank)."""
    import subprocess
    import sys

    import torch
    from torch import nn

    from pipetrain.compat import to_empty

    def meta_model():
        with torch.device("meta"):
            m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 10, bias=False))
        m[3].weight.data = m[3].weight.data.t().contiguous().t()  # a transposed (non-default) stride
        return m

    ours, ref = meta_model(), meta_model()
    to_empty(ours, device="cpu")
    ref.to_empty(device="cpu")
    for (n, a), (_, b) in zip(ours.named_parameters(), ref.named_parameters()):
        assert (type(a), a.shape, a.stride(), a.dtype, a.device, a.requires_grad) == \
            (type(b), b.shape, b.stride(), b.dtype, b.device, b.requires_grad), n
    code = ("import sys, torch\nfrom pipetrain.compat import to_empty\n"
            "with torch.device('meta'):\n    m = torch.nn.Linear(4, 6)\n"
            "to_empty(m, device='cpu')\nassert m.weight.device.type == 'cpu'\n"
            "assert 'sympy' not in sys.modules, 'sympy was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
