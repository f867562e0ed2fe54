"""Hugging Face folders in and out, against transformers: model.pretrained (sharded safetensors)
gives HF's logits within 1e-5; each rank opens only the files holding its stages' keys; a
missing, extra or mis-shaped key fails in one line, and so does a damaged file (config.json
missing a key or not JSON, a git-lfs pointer, a truncated shard), naming it; mode=export writes a folder from_pretrained
loads (identical tensors without training, equal logits after a 2-rank training step);
mode=eval on 2 pipeline ranks equals HF's loss on the same windows within 1e-5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from test_llama_hf import CASES as HF_CASES
from pipetrain.models.hf import PretrainedWeights, check_pretrained
from pipetrain.models.llama import hf_name
from pipetrain.models.split import split_model
from pipetrain.plan import build_model, make_plan

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")
safetensors_torch = pytest.importorskip("safetensors.torch")

# The tiny shapes test_llama_hf.py checks in memory: GQA, Llama 3 RoPE scaling, tied and untied, Qwen2 biases.
CASES = {case: HF_CASES[case] for case in ("llama-gqa-llama3-untied", "llama-llama3-tied", "qwen2-qkv-bias-tied")}
UNTIED, TIED = "llama-gqa-llama3-untied", "llama-llama3-tied"
TOKENS, T = 1000, 16  # (1000 - 1) // 16 = 62 windows: batch_size 4 leaves a short last batch of 2
BASE = ["model=llama-tiny", "data=tokens", "data.val_fraction=0", f"data.seq_len={T}", "data.batch_size=4",
        "pipeline.microbatches=2", "trainer.device=cpu", "logger=[]"]


class Folders(dict):
    """case -> an HF folder saved in ~40 kB shards (a dozen files), next to a token file <folder>.bin;
    each built the first time a test asks for it."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, case: str) -> Path:
        model_cls, config_cls, kw = CASES[case]
        torch.manual_seed(0)
        hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw))
        with torch.no_grad():  # HF starts norms at 1 and biases at 0: randomize all, so each one matters
            for name, p in hf.named_parameters():
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.1 * torch.randn_like(p))
        hf.save_pretrained(self.root / case, max_shard_size="40KB")
        np.random.default_rng(0).integers(0, 96, TOKENS).astype(np.uint16).tofile(self.root / f"{case}.bin")
        self[case] = self.root / case
        return self[case]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("hf"))


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def hf_loss(folder: Path, tokens: Path) -> float:
    """HF's mean next-token loss over the windows mode=eval defines."""
    tok = np.fromfile(tokens, dtype=np.uint16).astype(np.int64)
    w = torch.from_numpy(tok[np.arange((len(tok) - 1) // T)[:, None] * T + np.arange(T + 1)])  # (W, T + 1)
    with torch.no_grad():
        logits = hf_model(folder)(w[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1)).item()


@pytest.mark.pure
@pytest.mark.parametrize("case", list(CASES))
def test_pretrained_folder_gives_hf_logits(case, folders, compose):
    config = compose(["mode=train", *BASE, f"model.pretrained={folders[case]}", f"data.path={folders[case]}.bin"])
    assert (config.model.hidden_size == 64
            and any("hidden_size=64 (was 128)" in c for c in config.model.pretrained_changes))
    model = build_model(config.model, device="meta")
    rule = PretrainedWeights(config.model.pretrained, config.model.knobs())
    idx = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(folders[case])(idx).logits
        x = idx
        for stage in split_model(model, [range(0, 2), range(2, 5)], seed=0, rule=rule):
            x = stage(x)
    torch.testing.assert_close(x, ref, atol=1e-5, rtol=0)


def _opened(rank, world, out, config, plan, run_dir):
    from pipetrain.train.trainer import Trainer

    trainer = Trainer(config, plan, run_dir)
    keys = [hf_name(n, num_hidden_layers=3) for _, n, _ in trainer.pipe.named_parameters()]
    (out / f"opened{rank}.json").write_text(json.dumps({"opened": trainer.pretrained_files, "keys": keys}))
    # Leave together: a rank that tears its process group down while its peer is still in the
    # constructor's last collective can abort in gloo ("terminate called without an active exception").
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.dist
@pytest.mark.slow
def test_each_rank_opens_only_the_files_holding_its_keys(folders, compose, tmp_path):
    """Two real ranks build their stages through the trainer; each opened exactly the shards its keys live in."""
    from _dist import spawn

    folder = folders[UNTIED]
    config = compose(["mode=train", *BASE, f"model.pretrained={folder}", f"data.path={folder}.bin"])
    spawn(_opened, 2, tmp_path, config, make_plan(config), tmp_path)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    seen = []
    for rank in range(2):
        got = json.loads((tmp_path / f"opened{rank}.json").read_text())
        assert sorted(got["opened"]) == sorted({weight_map[k] for k in got["keys"]})
        seen.append(set(got["opened"]))
    assert (len(set(weight_map.values())) > 10
            and seen[0].isdisjoint(seen[1] - {weight_map["model.layers.1.mlp.down_proj.weight"]}))
    assert seen[0] | seen[1] == set(weight_map.values()) and len(seen[0]) < len(set(weight_map.values()))


@pytest.mark.pure
def test_missing_extra_and_misshaped_keys_fail_in_one_line(folders, compose, tmp_path):
    def broken(edit) -> str:
        folder = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folders[UNTIED], folder)
        edit(folder)
        config = compose(["mode=train", *BASE, f"model.pretrained={folder}", f"data.path={folders[UNTIED]}.bin"])
        with pytest.raises(ValueError) as err:
            check_pretrained(config.model)
        assert "\n" not in str(err.value)
        return str(err.value)

    def index(folder, change):
        path = folder / "model.safetensors.index.json"
        data = json.loads(path.read_text())
        change(data["weight_map"])
        path.write_text(json.dumps(data))

    def config_json(folder, **kw):
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **kw}))

    msg = broken(lambda f: index(f, lambda m: m.pop("model.layers.1.mlp.up_proj.weight")))
    assert "lacks model.layers.1.mlp.up_proj.weight" in msg
    msg = broken(lambda f: config_json(f, num_hidden_layers=2))  # layers.2 is then extra
    assert "holds model.layers.2." in msg and "extra" in msg
    msg = broken(lambda f: config_json(f, intermediate_size=100))
    assert "model.layers.0.mlp.down_proj.weight" in msg and "[64, 96]" in msg and "[64, 100]" in msg


def damaged(folders, compose, tmp_path, name: str, edit) -> str:
    """The one-line error of a copy of the untied folder that `edit` damaged, from composing its
    config or checking its files (both run before any rank starts)."""
    folder = tmp_path / name
    shutil.copytree(folders[UNTIED], folder)
    edit(folder)
    with pytest.raises(Exception) as err:
        check_pretrained(compose(["mode=train", *BASE, f"model.pretrained={folder}",
                                  f"data.path={folders[UNTIED]}.bin"]).model)
    e = err.value
    while not isinstance(e, ValueError) and isinstance(e.__cause__, Exception):  # OmegaConf wraps __post_init__'s
        e = e.__cause__
    assert isinstance(e, ValueError) and "\n" not in str(e), repr(err.value)
    return str(e)


@pytest.mark.pure
def test_damaged_files_fail_in_one_line_naming_the_file(folders, compose, tmp_path):
    def config_json(edit):
        def run(folder):
            path = folder / "config.json"
            data = json.loads(path.read_text())
            path.write_text(edit(data) if callable(edit) else edit)
        return run

    def drop_eps(data):
        data.pop("rms_norm_eps")
        return json.dumps(data)

    msg = damaged(folders, compose, tmp_path, "nokey", config_json(drop_eps))
    assert f"{tmp_path / 'nokey' / 'config.json'} lacks 'rms_norm_eps'" in msg and "original config.json" in msg
    msg = damaged(folders, compose, tmp_path, "notjson", config_json('{"model_type": "llama",\n'))
    assert f"{tmp_path / 'notjson' / 'config.json'} is not JSON" in msg and "re-save" in msg

    shard = sorted(json.loads((folders[UNTIED] / "model.safetensors.index.json").read_text())["weight_map"].values())[2]
    lfs = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 40960\n"
    msg = damaged(folders, compose, tmp_path, "lfs", lambda f: (f / shard).write_bytes(lfs))
    assert f"{tmp_path / 'lfs' / shard} is a git-lfs pointer, not the weights" in msg and "git lfs pull" in msg

    def truncate(folder):
        data = (folder / shard).read_bytes()
        (folder / shard).write_bytes(data[:-100])
    msg = damaged(folders, compose, tmp_path, "trunc", truncate)
    assert f"{tmp_path / 'trunc' / shard} is truncated" in msg and "download it again" in msg
    msg = damaged(folders, compose, tmp_path, "junk", lambda f: (f / shard).write_bytes(b"\xff" * 64))
    assert f"{tmp_path / 'junk' / shard} is not a safetensors file" in msg
    msg = damaged(folders, compose, tmp_path, "index", lambda f: (f / "model.safetensors.index.json").write_text("{"))
    assert "model.safetensors.index.json is not JSON" in msg


@pytest.mark.e2e
def test_cli_config_json_missing_a_key_is_one_line(folders, tmp_path):
    folder = tmp_path / "nokey"
    shutil.copytree(folders[UNTIED], folder)
    data = json.loads((folder / "config.json").read_text())
    data.pop("rms_norm_eps")
    (folder / "config.json").write_text(json.dumps(data))
    res = run_cli(["mode=export", "model=llama-tiny", f"model.pretrained={folder}", f"hydra.run.dir={tmp_path / 'r'}"],
                  cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"pipetrain: error: model.pretrained: {folder / 'config.json'} lacks 'rms_norm_eps', which pipetrain needs "
        f"to build the model: copy it from the model's original config.json"], res.stderr[-2000:]


def cli(args, tmp_path, name):
    res = run_cli([*args, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp_path / name


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


def save_chat_tokenizer(folder: Path) -> list[str]:
    """A word-level tokenizer with a chat template, saved by transformers into `folder`; the files it wrote."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return [Path(f).name for f in fast.save_pretrained(folder) if Path(f).is_file()]


@pytest.mark.e2e
def test_export_without_training_gives_identical_tensors(folders, tmp_path):
    """The weights bit for bit, and every tokenizer file of the folder, its chat template included (#44)."""
    src = tmp_path / "src"
    shutil.copytree(folders[TIED], src)
    saved = save_chat_tokenizer(src)
    assert "chat_template.jinja" in saved, saved
    run = cli(["mode=export", "model=llama-tiny", f"model.pretrained={src}", "export.max_shard_gb=0.0001"],
              tmp_path, "export")
    out = run / "hf"
    for name in saved:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    ours, theirs = read_folder(out), read_folder(src)
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" not in ours  # tied: the embedding only
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(out.glob("*.safetensors"))) > 1
    assert not list(run.glob(".hf*"))  # the temporary directory was renamed


@pytest.mark.e2e
@pytest.mark.slow
def test_hf_train_two_ranks_export_from_pretrained_equal_logits(folders, tmp_path):
    """HF -> pipetrain (2 ranks, 1 step) -> mode=export -> from_pretrained: logits equal pipetrain's
    model loaded from the same checkpoint."""
    src = folders[UNTIED]
    common = [*BASE, f"model.pretrained={src}", f"data.path={src}.bin"]
    train = cli(["mode=train", *common, "trainer.max_steps=1", "trainer.eval_every=0"], tmp_path, "train")
    ckpt = sorted((train / "checkpoints").glob("step_*"))[-1]
    out = tmp_path / "exported"
    cli(["mode=export", *common, f"trainer.resume={ckpt}", f"export.dir={out}"], tmp_path, "export")
    import torch.distributed.checkpoint as dcp

    from pipetrain.config import LlamaModelConfig
    from pipetrain.models.llama import Llama

    ours = Llama(**LlamaModelConfig.from_hf(json.loads((src / "config.json").read_text())).knobs()).eval()
    state = {f"model.{k}": v for k, v in ours.state_dict().items()}
    dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    ours.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    before = read_folder(src)
    assert not torch.equal(read_folder(out)["model.layers.0.mlp.up_proj.weight"],
                           before["model.layers.0.mlp.up_proj.weight"])  # the step changed the weights
    idx = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(out)(idx).logits, ours(idx), atol=1e-5, rtol=0)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_eval_on_two_pipeline_ranks_equals_hf_loss(case, folders, tmp_path):
    src = folders[case]
    run = cli(["mode=eval", *BASE, f"model.pretrained={src}", f"data.path={src}.bin"], tmp_path, "eval")
    result = json.loads((run / "eval.json").read_text())
    assert result["tokens"] == (TOKENS - 1) // T * T  # 62 windows of 16 targets; the last batch is short
    assert abs(result["loss"] - hf_loss(src, Path(f"{src}.bin"))) < 1e-5
