"""Private torch APIs live in pipetrain/compat.py only, and its version-dependent readers handle
both layouts: FSDP2's state holds a list of parameter groups in torch 2.13 and one group in 2.11
(where the H200 check's FSDP2 test failed on the newer attribute name)."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipetrain.compat import fsdp_state_param_groups

pytestmark = pytest.mark.pure
PACKAGE = Path(__file__).resolve().parents[1] / "pipetrain"
# private names that are not reaching into torch's internals: the fused foreach kernel every torch
# optimizer uses, and the compile stack imported only to warm the fork server up
PUBLIC_ENOUGH = {"_foreach_mul_", "_dynamo"}


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


def _private_torch_uses(tree: ast.AST) -> list[str]:
    """`torch.x._y` / `dist._y` attribute reads and `from torch.x._y import ...` / `import _y`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = [*node.module.split("."), *(a.name for a in node.names)]
            found += [f"from {node.module} import ..." for p in parts if p.startswith("_") and p not in PUBLIC_ENOUGH]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in ("torch", "dist") and node.attr not in PUBLIC_ENOUGH:
                found.append(f"{ast.unparse(node)}")
    return found


def test_private_torch_apis_only_in_compat():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "compat.py":
            continue
        uses = _private_torch_uses(ast.parse(path.read_text()))
        if uses:
            offenders[str(path.relative_to(PACKAGE))] = uses
    assert not offenders, f"move these into pipetrain/compat.py: {offenders}"


def test_the_check_finds_what_it_looks_for():
    code = "import torch\nfrom torch.distributed.tensor._utils import f\nx = torch.cuda.memory._dump_snapshot\n"
    assert len(_private_torch_uses(ast.parse(code))) == 2
