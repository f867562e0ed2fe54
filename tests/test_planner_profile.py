"""partition=profile and the planner's measurements (review F3): one layer on the device at a time,
timed under the run's autocast, and measured by rank 0 alone where every rank process plans."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipetrain.compose import compose_config
from pipetrain.models.profile import profile_layers, saved_bytes_per_token
from pipetrain.plan import build_model, make_plan
from pipetrain.planner.cmd import workload

pytestmark = pytest.mark.pure

# an mlp of 12 layers of 2048 x 2048 fp32 weights: 17 MB a layer, 201 MB whole
BIG = ["model=mlp", "model.n_layer=12", "model.d_hidden=2048", "partition=profile", "trainer.device=cpu",
       "pipeline.degree=2", "pipeline.microbatches=2", "data.batch_size=4"]
LAYER_MB, WHOLE_MB = 2048 * 2048 * 4 / 2**20, 12 * 2048 * 2048 * 4 / 2**20

PEAK = """
import sys
from pipetrain.compose import compose_config
from pipetrain.plan import make_plan
cfg = compose_config(sys.argv[1:])
import torch
def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
small = compose_config([*sys.argv[1:], "model.d_hidden=16"])
make_plan(small)  # the imports and first uses a profile pays once, out of the count
before = rss_mb("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from the current size
plan = make_plan(cfg)
assert plan.cost_source == "measured:cpu", plan.cost_source
print(rss_mb("VmHWM:") - before)
"""


@pytest.mark.slow  # 4-5 s on 2 quiet cores, about 10 s on busy ones (the fast tier's 2 minutes)
def test_profile_holds_one_layer_not_the_whole_model(tmp_path):
    """make_plan under partition=profile built the whole model on the device before timing it (1.07 GB
    here; a llama on GPU 0 in every rank process); now each layer is materialised, timed and freed:
    the process's peak resident memory grows by a few layers' weights and gradients."""
    res = subprocess.run([sys.executable, "-c", PEAK, *BIG], capture_output=True, text=True, timeout=120,
                         env={**_env(), "PIPETRAIN_CACHE_DIR": str(tmp_path),
                              # a fixed threshold: every large block is its own mapping, unmapped when freed
                              "MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert res.returncode == 0, res.stderr
    grew_mb = float(res.stdout.split()[-1])
    # a layer's weights and their gradients (2 x 16 MB) measured here; the whole model is 192 MB
    assert grew_mb < 4 * LAYER_MB == WHOLE_MB / 3, f"profiling grew the peak by {grew_mb:.0f} MB"


def _env():
    import os

    return dict(os.environ)


def test_profile_of_a_meta_model_materialises_each_layer_alone(tmp_path):
    """A model built on meta is what plan.py and the planner pass: every layer is measured on the
    device in turn, and only one materialised layer is alive at any time (weak references)."""
    import weakref

    model = build_model(compose_config(["model=mlp", "model.n_layer=4"]).model, device="meta")
    alive: list[weakref.ref] = []
    most = []

    def hook(module, args, out):
        if all(p.device.type == "cpu" for p in module.parameters()):
            if not any(r() is module for r in alive):
                alive.append(weakref.ref(module))
            most.append(sum(r() is not None for r in alive))

    for layer in model.layers:
        layer.register_forward_hook(hook)  # deep-copied with each materialised layer
    costs = profile_layers(model, batch=2, seq=1, iters=1, warmup=0, device="cpu", cache_dir=tmp_path)
    assert len(costs) == 4 and all(c.f_ms > 0 for c in costs)
    assert len(alive) == 4 and max(most) == 1, "one materialised layer alive at a time"
    assert all(p.device.type == "meta" for p in model.parameters())  # the model itself stays shapes only


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_profile_times_under_the_runs_autocast(tmp_path, precision, dtype):
    """trainer.precision=bf16 runs every stage under autocast to bf16: the profile times the layers
    so (their outputs are bf16 while timed), and caches bf16 apart from fp32."""
    model = build_model(compose_config(["model=mlp", "model.n_layer=3"]).model, device="cpu")
    seen = []
    model.layers[1].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    profile_layers(model, batch=2, seq=1, iters=2, warmup=1, cache_dir=tmp_path, precision=precision)
    assert seen and set(seen) == {dtype}
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["key"]["precision"] == precision


def test_saved_bytes_of_a_meta_model_match_the_real_models():
    """The planner's saved-bytes measurement materialises a layer at a time too, and counts what the
    whole real model counts."""
    cfg = compose_config(["model=gpt2-tiny"]).model
    meta, real = build_model(cfg, device="meta"), build_model(cfg, device="cpu")
    for view in (False, True):
        assert saved_bytes_per_token(meta, batch=2, seq=16, device="cpu", precision="bf16", boundary_inputs=view) == \
            saved_bytes_per_token(real, batch=2, seq=16, precision="bf16", boundary_inputs=view)


@pytest.mark.parametrize("cluster, var", [("torchrun", "RANK"), ("slurm", "SLURM_PROCID")])
def test_only_rank_0_profiles_where_every_rank_plans(tmp_path, monkeypatch, cluster, var):
    """Under torchrun / SLURM every rank process plans before the process group exists: rank 1 costs
    the layers analytically (it runs rank 0's broadcast plan) and times nothing; rank 0 measures."""
    monkeypatch.setenv("PIPETRAIN_CACHE_DIR", str(tmp_path))
    over = ["model=mlp", "model.n_layer=4", "partition=profile", "trainer.device=cpu", f"cluster={cluster}"]
    monkeypatch.setenv(var, "1")
    cfg = compose_config(over)
    assert make_plan(cfg).cost_source == "analytic"
    assert workload(cfg).layers(1) == build_model(cfg.model, device="meta").cost_model(
        microbatch=1, seq=1, tflops=cfg.sim.tflops)
    assert not list(tmp_path.rglob("*.json")), "rank 1 timed layers"
    monkeypatch.setenv(var, "0")
    assert make_plan(compose_config(over)).cost_source == "measured:cpu"
    assert len(list(tmp_path.rglob("*.json"))) == 1
