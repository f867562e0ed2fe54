"""`pipetrain --help` a new user can read: groups and options (no internal `*_schema`
entries), one line per setting from the schemas' comments, recipes (a `--config-dir` one
included, and accepted by `+recipe=`), examples."""

import pytest

from conftest import run_cli
from pipetrain.config import Mode
from pipetrain.help import render, section_settings

RECIPE = """\
# @package _global_
# My recipe: the sleep model simulated on 4 ranks.
defaults:
  - override /model: sleep
pipeline:
  degree: 4
mode: simulate
"""


@pytest.mark.pure
def test_every_setting_of_the_main_groups_has_a_description():
    sections = section_settings()
    checked = [s for title, items in sections.items() if title.split(" ")[0] in ("pipeline", "schedule", "model",
                                                                                 "trainer") for s in items]
    assert {s.key.split(".")[0] for s in checked} == {"pipeline", "schedule", "model", "trainer"}
    assert [s.key for s in checked if not s.doc] == []
    assert [s.key for items in sections.values() for s in items if not s.doc] == []  # the other groups too
    text = render([])
    for s in checked:  # each on one line of the help, with its description
        assert any(line.split()[:1] == [s.key] and line.rstrip().endswith(s.doc) for line in text.splitlines()), s.key


@pytest.mark.e2e
def test_help_lists_options_settings_and_config_dir_recipes_which_then_run(tmp_path):
    (tmp_path / "mine" / "recipe").mkdir(parents=True)
    (tmp_path / "mine" / "recipe" / "mine.yaml").write_text(RECIPE)
    res = run_cli(["--help", "--config-dir", str(tmp_path / "mine")], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "_schema" not in out and "Hydra" not in out.split("more:")[0]
    (options,) = [ln.split(None, 1)[1] for ln in out.splitlines() if ln.startswith("  schedule   ")]
    assert {"1f1b", "auto", "custom", "dualpipe", "zb_auto", "zbv"} <= set(options.split(", "))  # every shipped option
    assert "  pipeline.degree " in out and "P: pipeline ranks" in out
    assert "  mine " in out and "My recipe: the sleep model simulated on 4 ranks." in out
    assert "examples:" in out and "pipetrain mode=simulate model=sleep" in out
    run = run_cli(["--config-dir", str(tmp_path / "mine"), "+recipe=mine", "sim.timeline=false",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "run" / "simulate.json").is_file()
    unknown = run_cli(["+recipe=nope"], cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown recipe 'nope'" in unknown.stderr


@pytest.mark.pure
def test_the_mode_line_lists_every_mode_the_schema_has():
    (line,) = [ln for ln in render([]).splitlines() if ln.split()[:1] == ["mode"]]
    modes = [m.value for m in Mode]
    assert "plan" in modes and line.split(None, 2)[2].startswith(" | ".join(modes) + " ")
