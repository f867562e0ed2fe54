"""Hugging Face deepseek_v3 folders in and out (models/hf_deepseek.py, #47).

A tiny DeepseekV3ForCausalLM built by transformers here (MLA with YaRN, a dense first block of width 160, then
DeepSeekMoE: 4 experts in 2 groups, a shared expert), every weight randomized and a nonzero aux-free bias
(`e_score_correction_bias`), saved with save_pretrained; an MTP layer is added as DeepSeek-V3's release
stores one (`model.layers.{N}.`: eh_proj, enorm, hnorm, shared_head.norm, a block's keys, copies of the
embedding and head), which transformers ignores. Loaded through model.pretrained on 2 pipeline stages: the
logits equal transformers' within 1e-5 and the MTP layer and biases are the folder's; each expert read
alone for an EP rank's block; on 4 ranks (pp=2 x dp_shard=2 x ep=2) mode=eval equals transformers' loss
within 1e-4; mode=export writes the folder's keys back (MTP layer and bias included) with the same values
and from_pretrained gives the same logits. The folder converted to FP8 in the test (float8_e4m3fn with
128 x 128 block scales `weight_scale_inv`, as the official release) loads as weight x scale per block, within
FP8's rounding of the original; an FP8 weight without its scales is refused in one line before any rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipetrain.models.hf import PretrainedWeights, check_pretrained
from pipetrain.models.split import split_model
from pipetrain.plan import build_model

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
safetensors_torch = pytest.importorskip("safetensors.torch")

N, C, V = 3, 32, 96
KW = dict(vocab_size=V, hidden_size=C, intermediate_size=160, moe_intermediate_size=16, num_hidden_layers=N,
          num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
          qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
          n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64,
          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
MTP_OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
IDX = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(5))


def hf_model():
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**KW, attn_implementation="eager"))
    with torch.no_grad():  # HF starts norms at 1 and the bias at 0: randomize all, so each one matters
        for name, p in hf.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return hf.eval()


def add_mtp_layer(folder: Path) -> None:
    """The release's MTP layer N: a block like the last (its keys, perturbed), its own norms and eh_proj, and
    copies of the embedding and head."""
    path = folder / "model.safetensors"
    state = safetensors_torch.load_file(str(path))
    g = torch.Generator().manual_seed(1)
    last = f"model.layers.{N - 1}."
    mtp = {f"model.layers.{N}.{k[len(last):]}": v + 0.1 * torch.randn(v.shape, generator=g)
           for k, v in state.items() if k.startswith(last)}
    mtp.update({f"model.layers.{N}.{k}": (k != "eh_proj.weight") + 0.2 * torch.randn(shape, generator=g)
                for k, shape in zip(MTP_OWN, [(C, 2 * C), (C,), (C,), (C,)])})
    mtp[f"model.layers.{N}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{N}.shared_head.head.weight"] = state["lm_head.weight"].clone()
    safetensors_torch.save_file({**state, **mtp}, str(path), metadata={"format": "pt"})


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization: per 128 x 128 block scale = amax / 448, weight / scale in e4m3."""
    r, c = w.shape
    rb, cb = -(-r // 128), -(-c // 128)
    pad = torch.zeros(rb * 128, cb * 128)
    pad[:r, :c] = w
    scale = (pad.view(rb, 128, cb, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)  # (rb, cb)
    q = (pad.view(rb, 128, cb, 128) / scale[:, None, :, None]).view(rb * 128, cb * 128)[:r, :c]
    return q.to(torch.float8_e4m3fn), scale


def fp8_folder(source: Path, out: Path) -> Path:
    """`source` with every matmul weight (the attention's and MLPs' projections, the experts') in FP8."""
    shutil.copytree(source, out)
    state = safetensors_torch.load_file(str(source / "model.safetensors"))
    for key in [k for k in state if k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight")]:
        state[key], state[key + "_scale_inv"] = to_fp8(state[key])
    safetensors_torch.save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = hf_model()
    path = tmp_path_factory.mktemp("deepseek_v3") / "bf"
    hf.save_pretrained(path)
    add_mtp_layer(path)
    return hf, path


def loaded(compose, folder: Path, depth: int = 1):
    """The model of `folder` on 2 pipeline stages (embed + 2 blocks | block 3 + head with its MTP), its rule."""
    config = compose(["model=deepseek-tiny", f"model.pretrained={folder}", f"model.mtp.depth={depth}",
                      "mode=simulate"])
    check_pretrained(config.model)
    rule = PretrainedWeights(config.model.pretrained, config.model.knobs())
    return split_model(build_model(config.model, device="meta"), [range(0, 3), range(3, N + 2)], seed=0,
                       rule=rule), rule


def logits(stages) -> torch.Tensor:
    x = IDX
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
    return x[..., :V]  # a head with MTP returns its input beside the logits


@pytest.mark.pure
def test_the_folder_loads_with_transformers_logits_and_its_mtp_layer(folder, compose):
    hf, path = folder
    stages, _ = loaded(compose, path)
    with torch.no_grad():
        torch.testing.assert_close(logits(stages), hf(IDX).logits, atol=1e-5, rtol=0)
    state = safetensors_torch.load_file(str(path / "model.safetensors"))
    params = {n: p for stage in stages for n, p in stage.named_parameters()}
    head = f"layers.{N + 1}.mtp.0"
    for key in MTP_OWN:
        assert torch.equal(params[f"{head}.{key}"], state[f"model.layers.{N}.{key}"]), key
    w1 = torch.stack([state[f"model.layers.{N}.mlp.experts.{j}.gate_proj.weight"] for j in range(4)])
    assert torch.equal(params[f"{head}.block.mlp.experts.w1"], w1)
    for layer, name in ((2, "layers.3.mlp.router.expert_bias"), (N, f"{head}.block.mlp.router.expert_bias")):
        bias = dict(stages[0].named_buffers()) | dict(stages[1].named_buffers()) | params
        assert torch.equal(bias[name], state[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]), name


@pytest.mark.pure
def test_a_deepseek_v2_folder_loads_with_transformers_logits(compose, tmp_path):
    """V2-Lite's shape (no query compression, softmax scores, greedy top-k, 2 shared experts, no bias)."""
    kw = {k: v for k, v in KW.items() if k not in ("n_group", "topk_group", "rope_scaling")}
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **{**kw, "q_lora_rank": None, "n_shared_experts": 2}, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path / "v2")
    stages, _ = loaded(compose, tmp_path / "v2", depth=0)
    with torch.no_grad():
        torch.testing.assert_close(logits(stages), hf(IDX).logits, atol=1e-5, rtol=0)


@pytest.mark.pure
def test_an_ep_rank_reads_only_its_experts_of_every_block_and_the_mtp_block(folder, compose):
    _, path = folder
    config = compose(["model=deepseek-tiny", f"model.pretrained={path}", "model.mtp.depth=1", "mode=simulate"])
    model = build_model(config.model, device="meta")
    for name in ("layers.2.mlp.experts.w2", f"layers.{N + 1}.mtp.0.block.mlp.experts.w1"):
        rule = PretrainedWeights(config.model.pretrained, config.model.knobs())
        shape = model.get_parameter(name).shape
        rule.init_block(name, shape, (0, 2, 4), torch.empty(2, *shape[1:]), torch.Generator())
        assert {int(k.split(".experts.")[1].split(".")[0]) for k in rule.read} == {2, 3}, rule.read


@pytest.mark.pure
def test_export_writes_the_folder_back_and_transformers_reads_it(folder, compose, tmp_path):
    from pipetrain.train.export import run_export

    hf, path = folder
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = run_export(compose(["mode=export", "model=deepseek-tiny", f"model.pretrained={path}", "model.mtp.depth=1",
                              "export.dtype=fp32", f"export.dir={tmp_path / 'out'}"]), run_dir, note=lambda _: None)
    source = safetensors_torch.load_file(str(path / "model.safetensors"))
    keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(keys) == set(source)  # the MTP layer, its copies and every e_score_correction_bias included
    for file in set(keys.values()):
        for key, value in safetensors_torch.load_file(str(out / file)).items():
            assert torch.equal(value, source[key]), key
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(IDX).logits, hf(IDX).logits, atol=1e-5, rtol=0)


@pytest.mark.pure
def test_an_fp8_folder_with_block_scales_loads_within_fp8_rounding(folder, compose, tmp_path):
    _, path = folder
    fp8 = fp8_folder(path, tmp_path / "fp8")
    (ref, _), (got, rule) = loaded(compose, path), loaded(compose, fp8)
    assert any(k.endswith("_scale_inv") for k in rule.read)  # the scales were read
    want = {n: p for stage in ref for n, p in stage.named_parameters()}
    for stage in got:
        for name, p in stage.named_parameters():
            # e4m3: 3 mantissa bits (rounding <= 2^-4 relative), below 2^-6 of the block's scale subnormal steps
            bound = 2.0 ** -4 * want[name].abs() + 2.0 ** -9 * want[name].abs().max() / 448 * 2
            assert bool(((p - want[name]).abs() <= bound + 1e-12).all()), name
    # and exactly the blockwise weight x scale, computed here on the (rb, 128, cb, 128) view
    state = safetensors_torch.load_file(str(fp8 / "model.safetensors"))
    for key in [k for k in state if k.endswith("_scale_inv")]:
        q, scale = state[key.removesuffix("_scale_inv")], state[key]
        (r, c), (rb, cb) = q.shape, scale.shape
        pad = torch.zeros(rb * 128, cb * 128)
        pad[:r, :c] = q.float()
        state[key.removesuffix("_scale_inv")] = (pad.view(rb, 128, cb, 128) * scale[:, None, :, None]).view(
            rb * 128, cb * 128)[:r, :c].contiguous()
        del state[key]
    plain = tmp_path / "dequantized"
    shutil.copytree(path, plain)
    safetensors_torch.save_file(state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    exact = {n: p for stage in loaded(compose, plain)[0] for n, p in stage.named_parameters()}
    assert all(torch.equal(p, exact[n]) for stage in got for n, p in stage.named_parameters())


@pytest.mark.pure
def test_an_fp8_folder_without_scales_is_refused_in_one_line(folder, compose, tmp_path):
    _, path = folder
    fp8 = fp8_folder(path, tmp_path / "fp8")
    state = safetensors_torch.load_file(str(fp8 / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    safetensors_torch.save_file(state, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = compose(["model=deepseek-tiny", f"model.pretrained={fp8}", "mode=simulate"])
    with pytest.raises(ValueError) as err:
        check_pretrained(config.model)
    assert "model.layers.1.self_attn.o_proj.weight is float8_e4m3fn without " \
           "model.layers.1.self_attn.o_proj.weight_scale_inv" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.pure
def test_an_mtp_depth_the_folder_has_no_layer_for_is_refused_in_one_line(compose, tmp_path):
    hf_model().save_pretrained(tmp_path / "plain")  # transformers leaves the MTP layer out
    config = compose(["model=deepseek-tiny", f"model.pretrained={tmp_path / 'plain'}", "model.mtp.depth=1",
                      "mode=simulate"])
    with pytest.raises(ValueError) as err:
        check_pretrained(config.model)
    assert f"has no MTP layer model.layers.{N}.*" in str(err.value) and "set model.mtp.depth=0" in str(err.value)
    assert "\n" not in str(err.value)
    check_pretrained(compose(["model=deepseek-tiny", f"model.pretrained={tmp_path / 'plain'}", "mode=simulate"]).model)


@pytest.mark.e2e
@pytest.mark.slow
def test_eval_at_pp2_dp2_ep2_equals_transformers_loss(folder, tmp_path):
    """`pipetrain mode=eval model.pretrained=DIR` (the family from config.json: deepseek-tiny's) on 4 ranks,
    pipeline.degree=2 x dp_shard=2 x ep=2 with the MTP layer loaded: transformers' loss within 1e-4."""
    import numpy as np

    from conftest import run_cli

    hf, path = folder
    tokens, t = tmp_path / "tokens.bin", 16
    tok = np.random.default_rng(0).integers(0, V, 600).astype(np.uint16)
    tok.tofile(tokens)
    res = run_cli(["mode=eval", f"model.pretrained={path}", "model.mtp.depth=1", "data=tokens",
                   f"data.path={tokens}", "data.val_fraction=0", f"data.seq_len={t}", "data.batch_size=4",
                   "pipeline.degree=2", "parallel.dp_shard=2", "parallel.ep=2", "pipeline.microbatches=2",
                   "trainer.device=cpu", "logger=[]", f"hydra.run.dir={tmp_path / 'eval'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    w = torch.from_numpy(tok.astype(np.int64)[np.arange((len(tok) - 1) // t)[:, None] * t + np.arange(t + 1)])
    with torch.no_grad():
        out = hf(w[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(out.reshape(-1, V), w[:, 1:].reshape(-1)).item()
    assert abs(result["loss"] - want) < 1e-4, (result, want)
    assert "mtp/loss_1" in json.dumps(result)
