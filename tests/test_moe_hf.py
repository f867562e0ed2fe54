"""Hugging Face MoE folders through model.pretrained, against transformers (no download: tiny
random models built here): Mixtral, Qwen3-MoE, Qwen2-MoE (gated shared expert, a dense block via
mlp_only_layers) and OLMoE (QK-norm over all heads), each saved per expert (save_pretrained, as the
hub's originals) and fused (transformers 5's `experts.gate_up_proj` / `down_proj` tensors), loaded
into 2 pipeline stages: logits within 1e-5 of transformers'. A missing or mis-shaped expert fails
in one line before any rank starts (check_pretrained, which the CLI runs first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipetrain.models.hf import PretrainedWeights, check_pretrained
from pipetrain.models.split import split_model
from pipetrain.plan import build_model

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, tie_word_embeddings=False)
CASES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(SHAPE, intermediate_size=48, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(SHAPE, intermediate_size=64, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                       head_dim=16, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(SHAPE, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1])),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(SHAPE, intermediate_size=24, num_experts=4,
                                                      num_experts_per_tok=2, eos_token_id=None)),
}
LAYOUTS = ("per_expert", "fused")


def hf_model(case: str):
    model_cls, config_cls, kw = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw, attn_implementation="eager"))
    with torch.no_grad():  # HF starts norms at 1: randomize all, so each one matters
        for name, p in hf.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
    return hf.eval()


def save(hf, folder: Path, layout: str) -> Path:
    """per_expert: save_pretrained (transformers 5 writes the hub's per-expert keys); fused: the
    in-memory state dict as it is (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I))."""
    if layout == "per_expert":
        hf.save_pretrained(folder)
    else:
        folder.mkdir(parents=True)
        hf.config.to_json_file(folder / "config.json")
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        safetensors_torch.save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    cache: dict[tuple[str, str], tuple[object, Path]] = {}

    def get(case: str, layout: str):
        if (case, layout) not in cache:
            hf = hf_model(case)
            cache[(case, layout)] = (hf, save(hf, root / f"{case}-{layout}", layout))
        return cache[(case, layout)]

    return get


@pytest.mark.pure
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_pretrained_moe_folder_gives_hf_logits_on_two_stages(case, layout, folders, compose):
    hf, folder = folders(case, layout)
    keys = json.dumps(sorted(safetensors_torch.load_file(folder / "model.safetensors")))
    assert ("gate_up_proj" in keys) == (layout == "fused")
    config = compose(["model=moe-tiny", f"model.pretrained={folder}", "mode=simulate"])
    assert config.model.moe is not None and config.model.moe.balance == "aux_loss"  # this run's choice, kept
    assert check_pretrained(config.model) is not None
    model = build_model(config.model, device="meta")
    rule = PretrainedWeights(config.model.pretrained, config.model.knobs())
    idx = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(idx).logits
        x = idx
        for stage in split_model(model, [range(0, 3), range(3, 5)], seed=0, rule=rule):
            x = stage(x)
    torch.testing.assert_close(x, ref, atol=1e-5, rtol=0)


@pytest.mark.pure
def test_qwen2_moe_keeps_its_dense_block_and_gated_shared_expert(folders, compose):
    _, folder = folders("qwen2_moe", "per_expert")
    model = build_model(compose(["model=moe-tiny", f"model.pretrained={folder}", "mode=simulate"]).model,
                        device="meta")
    kinds = [type(model.layers[1 + i].mlp).__name__ for i in range(3)]
    assert kinds == ["MoEBlock", "MLP", "MoEBlock"]
    assert model.layers[1].mlp.shared_experts.gate is not None


def _broken(folder: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / f"{folder.name}-broken"
    out.mkdir()
    (out / "config.json").write_bytes((folder / "config.json").read_bytes())
    state = safetensors_torch.load_file(folder / "model.safetensors")
    edit(state)
    safetensors_torch.save_file(state, str(out / "model.safetensors"))
    return out


def _drop_expert(state: dict, prefix: str) -> None:
    for key in [k for k in state if k.startswith(prefix)]:
        del state[key]


@pytest.mark.pure
@pytest.mark.parametrize("case, layout, edit, message", [
    ("qwen3_moe", "per_expert", lambda s: s.pop("model.layers.0.mlp.experts.3.up_proj.weight"),
     "lacks model.layers.0.mlp.experts.3.up_proj.weight (1 key(s) missing)"),
    ("mixtral", "per_expert", lambda s: _drop_expert(s, "model.layers.1.block_sparse_moe.experts.3."),
     "lacks model.layers.1.block_sparse_moe.experts.3.w1.weight (3 key(s) missing)"),
    ("qwen3_moe", "per_expert",
     lambda s: s.update({"model.layers.2.mlp.experts.1.down_proj.weight": torch.zeros(32, 20)}),
     "model.layers.2.mlp.experts.1.down_proj.weight in model.safetensors has shape [32, 20] but config.json's "
     "model needs [32, 24]"),
    ("qwen3_moe", "fused", lambda s: s.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 48, 32)}),
     "model.layers.0.mlp.experts.gate_up_proj in model.safetensors has shape [3, 48, 32] but config.json's "
     "model needs [4, 48, 32]"),
    ("mixtral", "fused", lambda s: s.pop("model.layers.2.mlp.experts.down_proj"),
     "lacks model.layers.2.mlp.experts.down_proj (1 key(s) missing)"),
])
def test_missing_or_misshaped_expert_fails_in_one_line(case, layout, edit, message, folders, compose, tmp_path):
    _, folder = folders(case, layout)
    config = compose(["model=moe-tiny", f"model.pretrained={_broken(folder, tmp_path, edit)}", "mode=simulate"])
    with pytest.raises(ValueError) as err:
        check_pretrained(config.model)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("case, layout", [("mixtral", "per_expert"), ("qwen2_moe", "fused")])
def test_eval_on_two_pipeline_ranks_equals_hf_loss(case, layout, folders, tmp_path):
    """`pipetrain mode=eval model=moe-tiny model.pretrained=DIR` on 2 pipeline ranks: HF's loss within 1e-5."""
    import numpy as np

    from conftest import run_cli

    hf, folder = folders(case, layout)
    tokens, t = tmp_path / "tokens.bin", 16
    tok = np.random.default_rng(0).integers(0, 96, 1000).astype(np.uint16)
    tok.tofile(tokens)
    res = run_cli(["mode=eval", "model=moe-tiny", f"model.pretrained={folder}", "data=tokens", f"data.path={tokens}",
                   "data.val_fraction=0", f"data.seq_len={t}", "data.batch_size=4", "pipeline.degree=2",
                   "pipeline.microbatches=2", "trainer.device=cpu", "logger=[]", f"hydra.run.dir={tmp_path / 'eval'}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    w = torch.from_numpy(tok.astype(np.int64)[np.arange((len(tok) - 1) // t)[:, None] * t + np.arange(t + 1)])
    with torch.no_grad():
        logits = hf(w[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1)).item()
    assert abs(result["loss"] - want) < 1e-5


def cli(args: list[str], tmp_path: Path, name: str) -> Path:
    from conftest import run_cli

    res = run_cli([*args, "trainer.device=cpu", f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / name


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_export_per_expert_loads_back_in_transformers(case, folders, tmp_path):
    """HF fused folder -> `pipetrain mode=export model.pretrained=DIR` (per-expert keys) -> from_pretrained:
    the same logits."""
    hf, folder = folders(case, "fused")
    cli(["mode=export", "model=moe-tiny", f"model.pretrained={folder}", f"export.dir={tmp_path / 'out'}"],
        tmp_path, "export")
    keys = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("gate_up_proj" in k for k in keys) and any(".experts.0." in k for k in keys)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    idx = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, hf(idx).logits, atol=1e-5, rtol=0)


@pytest.mark.e2e
@pytest.mark.slow
def test_moe_tiny_trained_with_ep_exports_as_mixtral(compose, tmp_path):
    """moe-tiny trained 2 steps at pp=2 x dp_shard=2 x ep=2 -> mode=export -> MixtralForCausalLM: logits
    equal pipetrain's model loaded from the same checkpoint (experts saved whole by their global index)."""
    import torch.distributed.checkpoint as dcp

    common = ["model=moe-tiny", "pipeline.degree=2", "parallel.dp_shard=2", "parallel.ep=2", "data.batch_size=8",
              "data.seq_len=16", "pipeline.microbatches=2", "logger=[]"]
    train = cli(["mode=train", *common, "trainer.max_steps=2", "trainer.eval_every=0"], tmp_path, "train")
    ckpt = sorted((train / "checkpoints").glob("step_*"))[-1]
    cli(["mode=export", *common, f"trainer.resume={ckpt}", f"export.dir={tmp_path / 'out'}"], tmp_path, "export")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "mixtral"
    model = build_model(compose(["model=moe-tiny", "mode=simulate"]).model, device="cpu").eval()
    with torch.no_grad():  # a tied head is saved under the embedding's name: one key per Parameter
        dcp.load({f"model.{n}": p for n, p in model.named_parameters()}, checkpoint_id=ckpt, no_dist=True)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    idx = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, model(idx), atol=1e-5, rtol=0)


@pytest.mark.pure
@pytest.mark.parametrize("override, why", [
    ("model.moe.score_func=sigmoid", "model.moe.score_func=sigmoid"),
    ("model.moe.first_dense_layers=1", "its mix of QK-norm, shared experts and dense blocks"),
])
def test_export_of_a_model_no_hf_class_computes_is_one_line(compose, override, why):
    from pipetrain.models.hf import hf_config

    with pytest.raises(ValueError) as err:
        hf_config(compose(["model=moe-tiny", override, "mode=simulate"]).model, dtype="fp32")
    assert f"mode=export: no Hugging Face MoE class computes this model ({why})" in str(err.value)


@pytest.mark.pure
@pytest.mark.parametrize("edit, words", [
    ({"num_local_experts": None}, "lacks 'num_local_experts', which pipetrain needs"),
    ({"num_experts_per_tok": 5}, "config.json num_experts_per_tok=5 exceeds its num_local_experts=4: the folder's "
                                 "config.json is inconsistent; fix it there"),
])
def test_an_inconsistent_mixtral_config_names_its_own_keys(tmp_path, edit, words):
    """A Mixtral config.json (written by transformers) without num_local_experts asks for that key, not
    Qwen's num_experts; top-k beyond its experts is blamed on the folder, not on model.moe.top_k (#44)."""
    from pipetrain.config.llama import LlamaModelConfig

    _, config_class, kwargs = CASES["mixtral"]
    getattr(transformers, config_class)(**kwargs).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(edit)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(ValueError) as err:
        LlamaModelConfig(name="mixtral", pretrained=str(tmp_path))
    assert words in str(err.value) and "model.moe.top_k" not in str(err.value), str(err.value)
