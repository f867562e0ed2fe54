"""GPT-2 in and out of Hugging Face, against real folders transformers wrote: a GPT2LMHeadModel
folder (one file or sharded) and a GPT2Model folder without the "transformer." prefix and with
the causal-mask buffers older checkpoints hold load into pipetrain's GPT-2 with HF's logits within
1e-5 (fp32), unsplit and in stages; a folder whose config.json or weights do not match fails in one
line naming the key; mode=export after two training steps on two ranks writes a folder that
GPT2LMHeadModel.from_pretrained loads with the logits of pipetrain's model from the same checkpoint;
from the command line, `model=gpt2-tiny model.pretrained=DIR` exports the folder's tensors unchanged
and evaluates on two pipeline ranks to HF's loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from pipetrain.models.gpt2 import GPT2
from pipetrain.config import GPT2ModelConfig
from pipetrain.models.hf import PretrainedWeights, check_folder, gpt2_knobs, hf_config
from pipetrain.models.split import split_model

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
safetensors_torch = pytest.importorskip("safetensors.torch")

SHAPE = dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=3, n_head=4, bos_token_id=None, eos_token_id=None)
BOUNDS = [[range(0, 5)], [range(0, 2), range(2, 5)], [range(0, 1), range(1, 4), range(4, 5)]]  # 5 pipeline layers


def save_hf(folder: Path, form: str) -> Path:
    """A random GPT-2 saved by transformers: `lm` (GPT2LMHeadModel, one file), `sharded` (the same
    in ~20 kB shards) or `legacy` (GPT2Model: no prefix, plus h.N.attn.bias mask buffers)."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE))
    with torch.no_grad():  # HF starts LayerNorms at (1, 0) and biases at 0: randomize all, so each one matters
        for name, p in hf.named_parameters():
            p.copy_((1.0 if ".ln_" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    if form == "legacy":
        hf.transformer.save_pretrained(folder)
        weights = safetensors_torch.load_file(folder / "model.safetensors")
        mask = torch.tril(torch.ones(SHAPE["n_positions"], SHAPE["n_positions"])).view(
            1, 1, *[SHAPE["n_positions"]] * 2)
        weights.update({f"h.{i}.attn.bias": mask.clone() for i in range(SHAPE["n_layer"])})
        safetensors_torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        hf.save_pretrained(folder, **({"max_shard_size": "20KB"} if form == "sharded" else {}))
    return folder


def hf_model(folder: Path):
    return transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hf") / "lm", "lm")


@pytest.mark.pure
@pytest.mark.parametrize("form", ["lm", "sharded", "legacy"])
def test_gpt2_folder_gives_hf_logits_unsplit_and_in_stages(form, tmp_path):
    folder = save_hf(tmp_path / form, form)
    knobs = gpt2_knobs(str(folder))
    assert knobs == dict(n_layer=3, n_head=4, n_embd=32, vocab_size=96, block_size=64)
    with torch.device("meta"):
        model = GPT2(**knobs)
    files = check_folder(str(folder), model)
    assert (len(set(files.values())) > 3) == (form == "sharded")
    assert hf_config(GPT2ModelConfig(pretrained=str(folder)), dtype="fp32")["architectures"] == ["GPT2LMHeadModel"]
    idx = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(folder)(idx).logits  # (B, T, V)
        assert ref.abs().max() > 1.0  # weights large enough that a wrong op (or an untransposed Conv1D) shows
        for bounds in BOUNDS:
            x = idx
            for stage in split_model(model, bounds, seed=0, rule=PretrainedWeights(str(folder), knobs)):
                x = stage.eval()(x)
            torch.testing.assert_close(x, ref, atol=1e-5, rtol=0, msg=f"{form} cut {[len(r) for r in bounds]}")


def broken(lm_folder: Path, tmp_path: Path, name: str, *, config: dict | None = None, drop: str | None = None) -> str:
    """The one-line error of a copy of the folder whose config.json got `config` (None values: the
    key removed), or whose weights lost the key `drop`."""
    folder = tmp_path / name
    shutil.copytree(lm_folder, folder)
    data = json.loads((folder / "config.json").read_text())
    for key, value in (config or {}).items():
        data.pop(key) if value is None else data.__setitem__(key, value)
    (folder / "config.json").write_text(json.dumps(data))
    if drop:
        weights = safetensors_torch.load_file(folder / "model.safetensors")
        del weights[drop]
        safetensors_torch.save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError) as err:
        with torch.device("meta"):
            model = GPT2(**gpt2_knobs(str(folder)))
        check_folder(str(folder), model)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.pure
def test_mismatched_gpt2_folder_fails_in_one_line_naming_the_key(lm_folder, tmp_path):
    msg = broken(lm_folder, tmp_path, "nokey", config={"n_embd": None})
    assert f"{tmp_path / 'nokey' / 'config.json'} lacks 'n_embd'" in msg and "original config.json" in msg
    msg = broken(lm_folder, tmp_path, "llama", config={"model_type": "llama"})
    assert "model_type='llama', not gpt2" in msg and "model=llama-tiny" in msg
    msg = broken(lm_folder, tmp_path, "relu", config={"activation_function": "relu"})
    assert "activation_function='relu'" in msg and "gelu_new" in msg
    msg = broken(lm_folder, tmp_path, "untied", config={"tie_word_embeddings": False})
    assert "tie_word_embeddings=False" in msg
    msg = broken(lm_folder, tmp_path, "deeper", config={"n_layer": 4})
    assert "lacks transformer.h.3." in msg and "key(s) missing" in msg
    msg = broken(lm_folder, tmp_path, "shallower", config={"n_layer": 2})
    assert "holds transformer.h.2." in msg and "extra" in msg
    msg = broken(lm_folder, tmp_path, "longer", config={"n_positions": 80})
    assert "transformer.wpe.weight" in msg and "[64, 32]" in msg and "[80, 32]" in msg
    msg = broken(lm_folder, tmp_path, "nomlp", drop="transformer.h.1.mlp.c_fc.weight")
    assert "lacks transformer.h.1.mlp.c_fc.weight" in msg


def cli(args: list[str], tmp_path: Path, name: str) -> Path:
    res = run_cli([*args, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / name


@pytest.mark.e2e
@pytest.mark.slow
def test_gpt2_trained_on_two_ranks_exports_a_folder_from_pretrained_loads(tmp_path):
    """pipetrain (2 ranks, 2 steps) -> mode=export -> GPT2LMHeadModel.from_pretrained: its logits equal
    pipetrain's model loaded from the same checkpoint, and the folder reads back into pipetrain."""
    common = ["model=gpt2-tiny", "model.n_layer=3", "data.seq_len=32", "data.batch_size=4", "pipeline.microbatches=2",
              "trainer.device=cpu", "logger=[]"]
    train = cli(["mode=train", *common, "trainer.max_steps=2", "trainer.eval_every=0"], tmp_path, "train")
    ckpt = sorted((train / "checkpoints").glob("step_*"))[-1]
    out = tmp_path / "exported"
    cli(["mode=export", *common, f"trainer.resume={ckpt}", f"export.dir={out}"], tmp_path, "export")
    import torch.distributed.checkpoint as dcp

    knobs = dict(n_layer=3, n_head=4, n_embd=128, vocab_size=512, block_size=256)
    ours = GPT2(**knobs).eval()
    state = {f"model.{k}": v for k, v in ours.state_dict().items() if k != "layers.4.lm_head.weight"}  # tied: wte
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    loaded = {k[len("model."):]: v for k, v in state.items()}
    ours.load_state_dict({**loaded, "layers.4.lm_head.weight": loaded["layers.0.wte.weight"]}, strict=True)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt2" and written["architectures"] == ["GPT2LMHeadModel"]
    assert gpt2_knobs(str(out)) == knobs
    initial = GPT2(**knobs, seed=1337).layers[1].attn.c_attn.weight  # trainer.seed's initial weights
    assert not torch.equal(ours.layers[1].attn.c_attn.weight, initial)  # the steps changed the weights
    idx = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf_model(out)
        torch.testing.assert_close(theirs(idx).logits, ours(idx), atol=1e-5, rtol=0)
        with torch.device("meta"):
            back = GPT2(**knobs)
        check_folder(str(out), back)
        (again,) = split_model(back, [range(0, 5)], seed=0, rule=PretrainedWeights(str(out), knobs))
        torch.testing.assert_close(again.eval()(idx), ours(idx), atol=0, rtol=0)


@pytest.mark.e2e
def test_model_pretrained_loads_a_gpt2_folder_from_the_command_line(lm_folder, tmp_path):
    """`model=gpt2-tiny model.pretrained=DIR`: the folder's config.json sets the shape (one line says
    what it changed), the weights come from its files: an export of it, untrained, holds the same
    tensors; a folder missing a shape key is one line naming it, before any rank starts."""
    out = tmp_path / "out"
    res = run_cli(["mode=export", "model=gpt2-tiny", f"model.pretrained={lm_folder}", f"export.dir={out}",
                   f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    said = " ".join(res.stdout.split())  # rich wraps long lines off a terminal
    assert f"model.pretrained={lm_folder}: its config.json sets " in said and "n_embd=32 (was 128)" in said, said
    theirs = safetensors_torch.load_file(lm_folder / "model.safetensors")
    mine = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in safetensors_torch.load_file(f).items()}
    assert sorted(mine) == sorted(k for k in theirs if k != "lm_head.weight")
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    broken = tmp_path / "broken"
    shutil.copytree(lm_folder, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["n_embd"]
    (broken / "config.json").write_text(json.dumps(config))
    res = run_cli(["model=gpt2-tiny", f"model.pretrained={broken}", f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1 and "lacks 'n_embd'" in lines[0], res.stderr[-3000:]
    assert not list((tmp_path / "run2").glob("error_rank*"))


@pytest.mark.e2e
def test_eval_of_a_gpt2_folder_on_two_pipeline_ranks_equals_hf_loss(lm_folder, tmp_path):
    """The ranks' path (the trainer's weight loading, each rank its stages): mode=eval of
    `model=gpt2-tiny model.pretrained=DIR` on 2 pipeline ranks gives HF's loss on the same windows."""
    T = 16
    tokens = torch.randint(0, 96, (1000,), generator=torch.Generator().manual_seed(3))
    tokens.numpy().astype("uint16").tofile(tmp_path / "tokens.bin")
    run = cli(["mode=eval", "model=gpt2-tiny", f"model.pretrained={lm_folder}", "data=tokens", "data.val_fraction=0",
               f"data.path={tmp_path / 'tokens.bin'}", f"data.seq_len={T}", "data.batch_size=4", "pipeline.degree=2",
               "pipeline.microbatches=2", "trainer.device=cpu", "logger=[]"], tmp_path, "eval")
    result = json.loads((run / "eval.json").read_text())
    n = (len(tokens) - 1) // T  # windows of T + 1 tokens, one apart by T
    assert result["tokens"] == n * T
    windows = tokens[torch.arange(n)[:, None] * T + torch.arange(T + 1)]  # (n, T + 1)
    with torch.no_grad():
        logits = hf_model(lm_folder)(windows[:, :-1]).logits  # (n, T, V)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))
    assert abs(result["loss"] - ref.item()) < 1e-5
