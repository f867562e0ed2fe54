import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
REPO = Path(__file__).resolve().parents[1]
TIERS = ("pure", "dist", "e2e")  # pyproject.toml [tool.pytest.ini_options] markers


def pytest_collection_modifyitems(config, items):
    """Every test is in exactly one tier (its own mark or its module's `pytestmark`), so that
    `-m pure`, `-m dist`, `-m e2e` split the suite without overlap."""
    wrong = [item.nodeid for item in items if len({m.name for m in item.iter_markers()} & set(TIERS)) != 1]
    if wrong:
        raise pytest.UsageError(f"mark each test with exactly one tier of {TIERS}: {', '.join(wrong[:5])}")


@pytest.fixture(scope="session")
def compose():
    """compose(overrides) -> typed Config, through the same Hydra path the CLI uses."""
    from pipetrain.compose import compose as compose_dict, to_config

    def _compose(overrides=(), typed=True):
        cfg = compose_dict(overrides)
        return to_config(cfg) if typed else cfg

    return _compose


def run_cli(args, cwd, env_extra=None, timeout=300):
    """Run the installed `pipetrain` console script for real."""
    import subprocess

    env = dict(os.environ, **(env_extra or {}))
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=timeout,
    )


def assert_torch_free(code: str) -> None:
    """Run `code` in a fresh interpreter and fail if it imported torch."""
    import subprocess

    full = "import sys\n" + code + "\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    res = subprocess.run([sys.executable, "-c", full], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
