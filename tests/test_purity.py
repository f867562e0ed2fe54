"""schedules/, the pure partitioners, metrics/, loggers/ and planner/ import no torch (simulation needs no
torch at all; rank 0 turns measurements into metrics and logs them from plain values)."""

import ast
from pathlib import Path

import pytest

from conftest import assert_torch_free

pytestmark = pytest.mark.pure

PURE_DIRS = ["pipetrain/schedules", "pipetrain/partition", "pipetrain/metrics", "pipetrain/loggers",
             "pipetrain/planner"]
REPO = Path(__file__).resolve().parents[1]


def test_no_torch_import_statements():
    offenders = []
    for d in PURE_DIRS:
        for path in (REPO / d).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, offenders


def test_simulation_path_does_not_load_torch():
    assert_torch_free(
        "from pipetrain.schedules import registry, render\n"
        "from pipetrain.schedules.simulate import simulate\n"
        "import pipetrain.plan, pipetrain.simulate_cmd\n"
        "for n in registry.names():\n"
        "    simulate(registry.build(n, 4, 16, registry.get(n).fixed_stages_per_rank or 2))\n"
    )
