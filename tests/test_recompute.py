"""Selective activation recompute (trainer.recompute=selective, parallel/recompute.py): a layer's declared
modules keep only their inputs. What each module set saves per layer is measured with the executor's own
saved-tensor accounting (runtime/step_result.py SavedBytes, what the recorder counts) against the cost
model (LayerCost.selective), within 10%; the gradients, through the split backward (B, then W), equal those
of no recompute within 1e-6, and W runs no recomputation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipetrain.parallel.layer_spec import RecomputePlanned
from pipetrain.parallel.recompute import recompute_modules
from pipetrain.plan import build_model
from pipetrain.runtime.backward import backward_input, backward_weight
from pipetrain.runtime.step_result import SavedBytes

pytestmark = pytest.mark.pure
ALL = ("norm", "attention", "mlp_act", "moe_act", "mla_up")
SETS = [(), *((m,) for m in ALL), ALL]
# DeepSeek's MLA blocks (the first dense, the second MoE) with and without the low-rank query
MODELS = ["llama-tiny", "moe-tiny", "deepseek-tiny", "deepseek-tiny model.q_lora_rank=null"]
B, T = 2, 16


def model_of(compose, name: str):
    torch.manual_seed(0)
    preset, *overrides = name.split()
    return build_model(compose([f"model={preset}", "model.num_hidden_layers=2", *overrides]).model)


def layer_input(i: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    if i == 0:
        return torch.randint(0, 512, (B, T), generator=g)
    return torch.randn(B, T, width, generator=g).requires_grad_()


@pytest.mark.parametrize("name", MODELS)
def test_saved_bytes_per_layer_are_the_cost_models(compose, name):
    model = model_of(compose, name)
    costs = model.cost_model(microbatch=B, seq=T, tflops=1.0)
    for modules in SETS:
        layers = copy.deepcopy(model.layers)
        for i, layer in enumerate(layers):
            had = recompute_modules(layer, modules, compiled=False)
            assert had == [m for m in modules if m in dict((n, 0) for n, _, _ in costs[i].recompute_modules)]
            counter = SavedBytes()
            x = layer_input(i, 128)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                out = layer(x)
                if i == len(layers) - 1:
                    model.loss(out, torch.zeros(B, T, dtype=torch.long))
            kept, _ = costs[i].selective(modules)
            measured = counter.bytes / (B * T)
            assert kept <= measured <= 1.1 * kept, (name, modules, i, measured, kept)


class Forwards(TorchFunctionMode):
    """Counts the recomputable modules' forward functions called (norms' rsqrt, attention, activations)."""

    FUNCS = (torch.rsqrt, F.scaled_dot_product_attention, F.silu, F.linear)  # F.linear: MLA's up-projections

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.FUNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_no_recompute_and_w_recomputes_nothing(compose, name):
    model = model_of(compose, name)
    block = model.layers[2]  # deepseek-tiny's: an MoE MLA block, every module
    grads = {}
    for modules in [(), ALL]:
        layer = copy.deepcopy(block)
        recompute_modules(layer, modules, compiled=False)
        x = layer_input(1, 128)
        out = layer(x)
        params = list(layer.parameters())
        with Forwards() as in_b:
            (gx,), work = backward_input([out], [torch.ones_like(out)], [x], params)
        with Forwards() as in_w:
            backward_weight(work)
        assert (in_b.calls > 0) == bool(modules) and in_w.calls == 0, (in_b.calls, in_w.calls)
        grads[modules] = [gx, *(p.grad for p in params if p.requires_grad)]
    plain, selective = grads.values()
    for a, b in zip(plain, selective, strict=True):  # within 1e-6 relative: a recomputed rsqrt or silu may round
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # its last bit otherwise (1.2e-6 seen at 2.9)


def test_recompute_config(compose):
    assert compose(["trainer.activation_checkpointing=true"]).trainer.recompute == "full"
    t = compose(["trainer.recompute=full"]).trainer
    assert t.activation_checkpointing and t.recompute_modules
    assert not compose(["model=llama-tiny", "trainer.recompute=selective"]).trainer.activation_checkpointing
    for bad, says in [(["trainer.recompute=some"], "trainer.recompute must be none, full, selective"),
                      (["trainer.recompute=selective", "trainer.activation_checkpointing=true"], "drop it"),
                      (["trainer.recompute_modules=[mlp]"], "trainer.recompute_modules must list"),
                      (["trainer.recompute=selective", "trainer.recompute_modules=[]"], "name some"),
                      # GPT-2 declares no module: selective would silently run as none
                      (["model=gpt2-tiny", "trainer.recompute=selective"], "set trainer.recompute=full or none"),
                      (["model=gpt2-tiny", "mode=plan", "plan.recompute_selective=true"],
                       "set plan.recompute_selective=false")]:
        with pytest.raises(ValueError, match=says):
            compose(bad)


@pytest.mark.parametrize("name", ["sleep", "mlp", "gpt2-tiny", "llama-tiny", "moe-tiny", "deepseek-tiny"])
def test_a_family_allows_selective_recompute_where_its_layers_declare_modules(compose, name):
    """ModelConfig.selective_recompute (what the config checks) says what the built layers declare."""
    m = compose([f"model={name}"]).model
    layers = build_model(m, device="meta").layers
    assert any(isinstance(layer, RecomputePlanned) and any(layer.recompute_plan().values())
               for layer in layers) == m.selective_recompute


def test_the_planner_searches_recompute_modes_per_stage(compose):
    """plan.recompute_selective: each recompute row also selective; plan.json rows carry the mode per stage, and
    a selective row keeps less than no recompute and more than full, and costs between them."""
    from pipetrain.planner.cmd import make_rows

    cfg = compose(["mode=plan", "model=llama-tiny", "data.seq_len=256", "data.batch_size=8", "plan.world_size=2",
                   "plan.pp=[2]", "plan.prune=false", "plan.schedules=[1f1b]", "plan.microbatch_sizes=[2]",
                   "plan.recompute=[false,true]", "plan.recompute_selective=true", "plan.recompute_partial=true"])
    rows, _ = make_rows(cfg)
    by = {(r.candidate.recompute_mode, r.candidate.recompute_ranks): r for r in rows if r.candidate.partition ==
          rows[0].candidate.partition}
    assert set(by) == {("none", None), ("full", None), ("full", 1), ("selective", None), ("selective", 1)}
    assert by[("selective", 1)].to_json()["recompute_per_stage"] == ["selective", "none"]
    assert by[("full", None)].to_json()["recompute_per_stage"] == ["full", "full"]
    act = {k: max(m.activations for m in r.memory) for k, r in by.items()}
    step = {k: r.pred_step_ms for k, r in by.items()}
    assert act[("full", None)] < act[("selective", None)] < act[("none", None)]
    assert step[("none", None)] < step[("selective", None)] < step[("full", None)]
