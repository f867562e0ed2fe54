"""conf/ and recipes/ ship inside the package: a built wheel runs from any directory."""

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.pure
def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "pipetrain").rglob("__init__.py")
    } | {"pipetrain.conf", "pipetrain.recipes"}
    assert found == listed


@pytest.mark.e2e
@pytest.mark.slow
def test_wheel_ships_configs_and_runs_outside_the_repo(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    wheel = next(tmp_path.glob("pipetrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("pipetrain/conf/config.yaml", "pipetrain/conf/schedule/zbv.yaml", "pipetrain/recipes/sleep-p8.yaml",
                 "pipetrain/launch/templates/pipetrain.sbatch"):
        assert must in names, must
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # -S: no site processing, so the development (editable) install cannot shadow the wheel;
    # dependencies come from this interpreter's site-packages as plain path entries.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]))
    env.pop("HYDRA_FULL_ERROR", None)
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = ("import sys, pipetrain.cli as c; assert c.__file__.startswith(sys.argv[1]); "
            "sys.argv = sys.argv[1:]; c.main()")
    res = subprocess.run(
        [sys.executable, "-S", "-c", code, str(site), "+recipe=sleep-p8", "schedule=dualpipev", "sim.timeline=false",
         f"hydra.run.dir={work / 'run'}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads((work / "run" / "simulate.json").read_text())["schedule"] == "dualpipev"
