import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
REPO = Path(__file__).resolve().parents[1]
TIERS = ("pure", "dist", "e2e", "gpu")  # pyproject.toml [tool.pytest.ini_options] markers
HIDDEN = "CUDA hidden from this run: select the gpu tier alone (python -m pytest -m gpu) to run it"


def gpu_visible(markexpr: str) -> bool:
    """The one rule for CUDA in tests: visible only when the -m expression selects the gpu tier
    and no other tier (`-m gpu`, `-m "gpu and not slow"`). Everything else (a plain run, `-m "not
    slow"`, `-m "gpu or pure"`) runs with CUDA hidden, so a pure / dist / e2e test never resolves
    trainer.device=auto or cluster.backend=auto to CUDA / NCCL on a GPU machine."""
    if not markexpr:
        return False
    from _pytest.mark.expression import Expression  # what -m itself evaluates

    expr = Expression.compile(markexpr)
    selects = lambda tier: expr.evaluate(lambda name, **_: name == tier)  # noqa: E731
    return selects("gpu") and not any(selects(tier) for tier in TIERS if tier != "gpu")


def pytest_configure(config):
    # Before any test module imports torch, and inherited by every process a test starts (the
    # ranks of tests/_dist.py, the `pipetrain` command): CUDA reads the variable when it initialises.
    if not gpu_visible(config.option.markexpr):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        other_cpu_kernels()  # in a process that runs tests (an xdist worker, or -n 0), not in xdist's controller
        own_inductor_cache()


def own_inductor_cache() -> None:
    """A fresh Inductor cache for this test process and the processes it starts (the ranks compile under
    trainer.compile): the machine's /tmp/torchinductor_$USER may hold kernels built under other CPU kernels
    (ATEN_CPU_CAPABILITY, other_cpu_kernels), and a compiled rank that loaded such a kernel died in free()
    ("double free or corruption") on this Xeon. Compiling from scratch is what a fresh CI machine does anyway."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _OWN_CACHE[0] = tempfile.mkdtemp(prefix="pipetrain-inductor-")


_OWN_CACHE = [""]  # the cache own_inductor_cache made, removed at the end (pytest_unconfigure)


def pytest_unconfigure(config):
    if _OWN_CACHE[0]:
        import shutil

        shutil.rmtree(_OWN_CACHE[0], ignore_errors=True)


def has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Linux: /proc/cpuinfo's flags)."""
    try:
        return " amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def other_cpu_kernels() -> None:
    """On an AVX-512 machine, the processes tests start (ranks, the `pipetrain` command) run torch's
    AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) while this process keeps AVX-512: every parity test that
    compares ranks with a reference computed here then compares two kernel sets whose sums, softmax
    and norms reduce in other orders, so a tolerance sized on one CPU fails on this one too, not only
    on another CI machine (issue #42; tests/_parity.py). AVX2, not the scalar `default`: random
    numbers (normal_) are drawn alike on AVX2 and AVX-512 but not by the scalar kernels, and tests
    that check a rank's slices of a seeded model bit for bit need the same weights on both sides.
    torch reads the variable once, at its first kernel: this process's is fixed first. A user's own
    ATEN_CPU_CAPABILITY applies to every process; an AVX2 machine runs all on AVX2. A CPU with AMX keeps
    AVX-512 everywhere: torch 2.13's bf16 attention packs its operands with AVX-512 instructions wherever the
    CPU has AMX, whatever ATEN_CPU_CAPABILITY says, and fails under avx2 ("pack_vnni2 is only supported when
    avx512 is supported", bf16 SDPA from 64 positions up)."""
    if "ATEN_CPU_CAPABILITY" in os.environ or has_amx():
        return
    import torch

    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):  # this process's kernels, chosen now and kept
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"


def pytest_collection_modifyitems(config, items):
    """Every test is in exactly one tier (its own mark or its module's `pytestmark`), so that
    `-m pure`, `-m dist`, `-m e2e`, `-m gpu` split the suite without overlap. gpu tests are
    skipped where CUDA is hidden (see gpu_visible) or absent."""
    wrong = [item.nodeid for item in items if len({m.name for m in item.iter_markers()} & set(TIERS)) != 1]
    if wrong:
        raise pytest.UsageError(f"mark each test with exactly one tier of {TIERS}: {', '.join(wrong[:5])}")
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        reason = "no CUDA device is visible" if gpu_visible(config.option.markexpr) else HIDDEN
        # PIPETRAIN_GPU_DRYRUN=1 (bench/gpu_check.sh --cpu): the gpu tests run their code on the CPU
        if not torch.cuda.is_available() and os.environ.get("PIPETRAIN_GPU_DRYRUN") != "1":
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason=reason))


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
