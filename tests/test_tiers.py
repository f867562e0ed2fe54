"""The test tiers' GPU rule (tests/conftest.py): CUDA is hidden from every test, and from every
process a test starts, unless the run selects the gpu tier alone."""

import subprocess
import sys

import pytest

from conftest import gpu_visible

pytestmark = pytest.mark.pure


def test_a_process_started_by_a_test_sees_no_cuda():
    # What the ranks of a dist test and the `pipetrain` of an e2e test inherit: without the hiding,
    # a GPU machine resolves trainer.device=auto / cluster.backend=auto to CUDA / NCCL in them.
    code = "import os, torch; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["''", "0"]


@pytest.mark.parametrize("expr, visible", [
    ("", False), ("gpu", True), ("gpu and not slow", True), ("not slow", False),
    ("not slow and not e2e", False), ("gpu or pure", False), ("not gpu", False), ("pure", False),
])
def test_only_the_gpu_tier_alone_sees_cuda(expr, visible):
    assert gpu_visible(expr) is visible
