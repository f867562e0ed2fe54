"""Which device and backend the ranks use, and which GPU is each rank's (launch/devices.py): one rule,
decided before any rank starts. CPU cannot show CUDA, so the rule is a pure function of the number
of visible GPUs and of the ranks on a host that share them; tests/test_gpu.py runs it on a GPU."""

from __future__ import annotations

import pytest

from conftest import run_cli
from pipetrain.config.cluster import ClusterConfig
from pipetrain.launch.devices import choose, gpu_index, ranks_sharing_gpus


def _cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:  # OmegaConf may wrap the __post_init__ error
        err = err.__cause__
    return err


@pytest.mark.pure
@pytest.mark.parametrize("device, backend, gpus, local_ranks, expected", [
    ("auto", "auto", 0, 2, ("cpu", "gloo", False)),  # a laptop
    ("auto", "auto", 1, 2, ("cpu", "gloo", True)),  # the quickstart's 2 ranks on a 1-GPU workstation (F15)
    ("auto", "auto", 2, 2, ("cuda", "nccl", False)),  # a GPU for each rank
    ("auto", "auto", 8, 2, ("cuda", "nccl", False)),
    ("auto", "auto", 1, None, ("cuda", "nccl", False)),  # a SLURM task that sees its own GPU
    ("auto", "gloo", 8, 2, ("cpu", "gloo", False)),  # an explicit backend decides the device
    ("auto", "nccl", 2, 2, ("cuda", "nccl", False)),
    ("cpu", "auto", 8, 2, ("cpu", "gloo", False)),  # backend=auto follows the device
    ("cuda", "auto", 8, 8, ("cuda", "nccl", False)),
    ("cuda", "auto", 1, None, ("cuda", "nccl", False)),
])
def test_device_and_backend_rule(device, backend, gpus, local_ranks, expected):
    got = choose(device, backend, gpus=gpus, local_ranks=local_ranks)
    assert (got.device, got.backend, got.note is not None) == expected
    if got.note:
        assert "\n" not in got.note and "2 ranks on this host but 1 visible GPU" in got.note
        assert "trainer.device=cuda with at most one rank per GPU" in got.note


@pytest.mark.pure
@pytest.mark.parametrize("device, backend, gpus, local_ranks, words", [
    ("cuda", "auto", 0, 1, "trainer.device=cuda needs a CUDA GPU and none is visible"),
    ("auto", "nccl", 0, 1, "cluster.backend=nccl needs a CUDA GPU and none is visible"),
    # F8: two ranks of one host on one GPU is NCCL's "Duplicate GPU detected" at the first collective
    ("cuda", "auto", 1, 2, "2 ranks on this host but 1 visible GPU (NCCL needs one GPU per rank)"),
    ("auto", "nccl", 4, 8, "8 ranks on this host but 4 visible GPUs"),
    # F4: refused at config time too (test_backend_and_device_that_cannot_work_together_are_refused)
    ("cpu", "nccl", 8, 1, "cluster.backend=nccl carries CUDA tensors but trainer.device=cpu"),
    ("cuda", "gloo", 8, 1, "cluster.backend=gloo cannot send CUDA tensors"),
])
def test_device_errors_are_one_line_naming_the_knob(device, backend, gpus, local_ranks, words):
    with pytest.raises(ValueError) as info:
        choose(device, backend, gpus=gpus, local_ranks=local_ranks)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert "set trainer.device" in str(info.value) or "set cluster.backend" in str(info.value)


@pytest.mark.pure
def test_one_rule_for_the_gpu():
    # F8: local rank i on GPU i where a rank sees every GPU of the host; GPU 0 where SLURM shows each
    # task only its own (--gpus-per-task=1), where cuda:LOCAL_RANK failed on every local rank but 0
    assert [gpu_index(r, 8) for r in range(8)] == list(range(8))
    assert [gpu_index(r, 1) for r in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        gpu_index(0, 0)


@pytest.mark.pure
def test_ranks_that_share_a_hosts_gpus():
    assert ranks_sharing_gpus(ClusterConfig(name="local"), 4, {}) == 4
    assert ranks_sharing_gpus(ClusterConfig(name="torchrun"), 16, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert ranks_sharing_gpus(ClusterConfig(name="torchrun"), 16, {}) is None
    assert ranks_sharing_gpus(ClusterConfig(name="submitit_local", ranks_per_node=2), 2, {}) == 2
    assert ranks_sharing_gpus(ClusterConfig(name="slurm", nodes=2), 16, {"SLURM_NTASKS_PER_NODE": "8"}) is None


@pytest.mark.pure
@pytest.mark.parametrize("backend, device", [("nccl", "cpu"), ("gloo", "cuda")])
def test_backend_and_device_that_cannot_work_together_are_refused(compose, backend, device):
    """F4: refused when the config is composed, on any machine, before anything is launched."""
    with pytest.raises(ValueError) as info:
        compose([f"cluster.backend={backend}", f"trainer.device={device}"])
    text = str(_cause(info.value))
    assert f"cluster.backend={backend}" in text and f"trainer.device={device}" in text and "\n" not in text


@pytest.mark.e2e
def test_the_command_refuses_nccl_on_cpu_before_any_rank_starts(tmp_path):
    res = run_cli(["cluster.backend=nccl", "trainer.device=cpu", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "pipetrain: error: cluster.backend=nccl carries CUDA tensors but trainer.device=cpu: set "
        "trainer.device=cuda (or auto), or cluster.backend=gloo (or auto)"]
    assert res.stdout == ""  # no plan, no simulation, no rank
