"""What the command imports before it does its work (#45): the commands that need no torch import
none, so they answer in the time Python and Hydra take, not torch's ~2 s (nor Hugging Face `datasets`' ~1 s)."""

from __future__ import annotations

import pytest

from conftest import assert_torch_free

pytestmark = pytest.mark.e2e

RUN = ["mode=simulate", "model=sleep"]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["--cfg", "job"], RUN, ["mode=simulate"],
                                  ["mode=plan", "model=sleep", "plan.world_size=4"],
                                  ["mode=plan", "plan.world_size=4"]],
                         ids=["help", "version", "cfg", "simulate-sleep", "simulate-quickstart", "plan-sleep",
                              "plan-quickstart"])
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


@pytest.mark.parametrize("model", ["sleep", "gpt2-tiny"], ids=["sleep", "quickstart"])
def test_the_launcher_imports_no_torch_before_the_ranks_start(tmp_path, model):
    """cluster=local on the CPU: the launching process starts its ranks (launch/agent.py) without having
    imported torch (the ranks fork from a server that has it); their result comes back all the same.
    Only a machine with a GPU driver (launch/devices.py: visible_gpus) or a model.pretrained folder
    (its keys checked on meta) makes the launcher import torch first. gpt2-tiny is the quickstart's model: its
    plan costs the layers from the config (models/costs.py), not from a model built on meta."""
    assert_torch_free(f"""
import pipetrain.launch.agent as agent
from pipetrain.cli import main

started = agent._start
seen = []


def watched(*args, **kwargs):
    seen.append("torch" in sys.modules)
    return started(*args, **kwargs)


agent._start = watched
sys.argv = ["pipetrain", "model={model}", "pipeline.degree=2", "trainer.max_steps=1", "trainer.ckpt_at_end=false",
            "logger=[jsonl]", "hydra.run.dir={tmp_path / 'run'}"]
main()
assert seen == [False], seen
""")
    assert (tmp_path / "run" / "summary.json").is_file()
