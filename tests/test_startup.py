"""What the command imports before it does its work (#45): the commands that need no torch import
none, so they answer in the time Python and Hydra take, not torch's ~2 s (nor Hugging Face `datasets`' ~1 s)."""

from __future__ import annotations

import pytest

from conftest import assert_torch_free

pytestmark = pytest.mark.e2e

RUN = ["mode=simulate", "model=sleep"]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["--cfg", "job"], RUN,
                                  ["mode=plan", "model=sleep", "plan.world_size=4"]],
                         ids=["help", "version", "cfg", "simulate-sleep", "plan-sleep"])
def test_commands_that_need_no_torch_import_none(tmp_path, args):
    """`pipetrain ARGS` through its entry point in a fresh interpreter (a run's directory under
    tmp_path); a failing command fails the test (--help and --version end in SystemExit(0))."""
    run_dir = [] if args[0].startswith("-") else [f"hydra.run.dir={tmp_path / 'run'}"]
    assert_torch_free(f"""
from pipetrain.cli import main
sys.argv = ["pipetrain", *{[*args, *run_dir]!r}]
try:
    main()
except SystemExit as e:
    assert e.code in (0, None), e.code
assert "datasets" not in sys.modules, "datasets was imported"  # ~1 s, only for data=datasets and prepare
""")
