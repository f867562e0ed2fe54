"""Hugging Face MoE folders under expert parallel, and exported fused.

Each EP rank reads only its own experts' bytes: `PretrainedWeights.init_block` (which materialize
calls for the contiguous block of experts a rank keeps) reads per-expert keys of those experts only,
or a dim-0 slice of the fused tensors; on two real gloo ranks (dp_shard=2 x ep=2, built by the
trainer) each rank reads half of every expert tensor's bytes, holds exactly the ep=1 load's experts
of its block, and the first step's loss equals one process's. mode=export with
export.moe_layout=fused writes transformers 5's key set, which pipetrain and from_pretrained load back
equal (w1 and w3 share one gate_up_proj, so they are kept in one shard even when shards are tiny).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from test_moe_hf import hf_model, save
from pipetrain.models.hf import PretrainedWeights, read_header, weight_map
from pipetrain.models.split import split_model
from pipetrain.plan import build_model, make_plan

transformers = pytest.importorskip("transformers", reason="the test extra: pip install -e '.[test]'")

LAYOUTS = ("per_expert", "fused")
BASE = ["mode=train", "model=moe-tiny", "pipeline.degree=1", "data=tokens", "data.val_fraction=0", "data.batch_size=4",
        "data.seq_len=16", "trainer.device=cpu", "logger=[]", "trainer.eval_every=0", "trainer.ckpt_at_end=false",
        "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """layout -> a tiny Mixtral folder (4 experts, 3 MoE blocks) in that layout, and the HF model."""
    root, hf = tmp_path_factory.mktemp("mixtral"), hf_model("mixtral")
    return hf, {layout: save(hf, root / layout, layout) for layout in LAYOUTS}


def expert_bytes(folder: Path) -> dict[str, int]:
    """HF key -> bytes on disk of every expert tensor of the folder (from its headers)."""
    out = {}
    for file in set(weight_map(folder).values()):
        for key, entry in read_header(folder / file).items():
            if ".experts." in key:
                out[key] = entry["data_offsets"][1] - entry["data_offsets"][0]
    return out


@pytest.mark.pure
@pytest.mark.parametrize("layout", LAYOUTS)
def test_init_block_reads_only_the_block_and_equals_the_whole_cut(layout, mixtral, compose):
    _, folders = mixtral
    config = compose(["model=moe-tiny", f"model.pretrained={folders[layout]}", "mode=simulate"])
    model = build_model(config.model, device="meta")
    whole_rule, block_rule = (PretrainedWeights(config.model.pretrained, config.model.knobs()) for _ in range(2))
    for name in ("layers.1.mlp.experts.w1", "layers.1.mlp.experts.w3", "layers.1.mlp.experts.w2"):
        shape = model.get_parameter(name).shape
        whole = torch.empty(shape)
        whole_rule.init_parameter(name, whole, torch.Generator())
        part = torch.empty(1, *shape[1:])
        block_rule.init_block(name, shape, (0, 2, 3), part, torch.Generator())
        assert torch.equal(part, whole[2:3])
    assert sum(block_rule.read.values()) * 4 == sum(whole_rule.read.values())  # 1 expert of 4
    if layout == "per_expert":
        assert all(".experts.2." in key for key in block_rule.read)


def _load(rank: int, world: int, out: Path, runs: list) -> None:
    import torch.distributed as dist

    import pipetrain.train.pipeline as pipeline_module  # where a rank's pipeline reads model.pretrained
    from pipetrain.models.hf import pretrained_rule
    from pipetrain.train.trainer import Trainer

    for name, config, plan in runs:
        rules = []

        def keep(model_config, rules: list = rules):  # the trainer's own rule, kept to count this run's reads
            rules.append(pretrained_rule(model_config))
            return rules[-1]

        pipeline_module.pretrained_rule = keep
        trainer = Trainer(config, plan, out / name)
        experts = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                   for _, n, p in trainer.pipe.named_parameters() if ".experts.w" in n}
        loss = trainer.train_step().loss
        torch.save({"read": rules[0].read, "ep": trainer.groups.ep_index, "experts": experts, "loss": loss},
                   out / f"{name}.rank{rank}.pt")
    dist.barrier()  # leave together (see test_hf_io.py: _opened)


@pytest.mark.dist
@pytest.mark.slow
def test_each_ep_rank_reads_only_its_experts(mixtral, compose, tmp_path):
    """dp_shard=2 x ep=2 on two gloo ranks, each layout: every rank reads half of each expert tensor's
    bytes (per expert: its two experts' keys of the four), holds the ep=1 load's experts of its block,
    and the first step's loss equals one process's (1-row microbatches on both)."""
    from _dist import spawn
    from pipetrain.train.trainer import Trainer

    _, folders = mixtral
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 96, 1000).astype(np.uint16).tofile(tokens)  # the folder's vocabulary
    base = [*BASE, f"data.path={tokens}"]
    runs = []
    for layout, folder in folders.items():
        config = compose([*base, f"model.pretrained={folder}", "parallel.dp_shard=2", "parallel.ep=2",
                          "pipeline.microbatches=2"])
        runs.append((layout, config, make_plan(config)))
    spawn(_load, 2, tmp_path, runs)
    for layout, folder in folders.items():
        one = compose([*base, f"model.pretrained={folder}", "pipeline.microbatches=4"])
        ref = Trainer(one, make_plan(one), tmp_path / f"{layout}-one")
        whole = {n: p.detach().clone() for _, n, p in ref.pipe.named_parameters() if ".experts.w" in n}
        ref_loss = ref.train_step().loss
        on_disk = expert_bytes(folder)
        got = [torch.load(tmp_path / f"{layout}.rank{r}.pt") for r in range(2)]
        assert sorted(g["ep"] for g in got) == [0, 1]
        for g in got:
            read = {k: b for k, b in g["read"].items() if ".experts." in k}
            assert sum(read.values()) * 2 == sum(on_disk.values()), (layout, g["ep"])
            if layout == "per_expert":
                assert {int(k.split(".experts.")[1].split(".")[0]) for k in read} == {2 * g["ep"], 2 * g["ep"] + 1}
                assert all(read[k] == on_disk[k] for k in read)
            else:  # half of each fused tensor: the rank's dim-0 slice
                assert set(read) == set(on_disk) and all(2 * read[k] == on_disk[k] for k in read)
            assert set(g["experts"]) == set(whole)
            for n, held in g["experts"].items():
                assert torch.equal(held, whole[n][2 * g["ep"]:2 * g["ep"] + 2]), (layout, n)
            assert abs(g["loss"] - ref_loss) < 1e-5, (layout, g["loss"], ref_loss)


@pytest.mark.pure
@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_export_fused_writes_transformers_keys_and_loads_back(case, compose, tmp_path):
    """per-expert folder -> mode=export export.moe_layout=fused (10 kB shards) -> the in-memory key set of
    transformers 5; pipetrain's model.pretrained and from_pretrained give the source's logits."""
    from pipetrain.train.export import run_export

    hf = hf_model(case)
    source = save(hf, tmp_path / "source", "per_expert")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = run_export(compose(["mode=export", "model=moe-tiny", f"model.pretrained={source}",
                              f"export.dir={tmp_path / 'out'}", "export.moe_layout=fused", "export.max_shard_gb=1e-5"]),
                     run_dir, note=lambda _: None)
    keys = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(keys) == set(hf.state_dict()) and any(k.endswith(".experts.gate_up_proj") for k in keys)
    assert len(set(keys.values())) > 3  # several shards, each gate_up_proj whole in one
    idx = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    config = compose(["model=moe-tiny", f"model.pretrained={out}", "mode=simulate"])
    rule = PretrainedWeights(config.model.pretrained, config.model.knobs())
    with torch.no_grad():
        ref, x = hf(idx).logits, idx
        for stage in split_model(build_model(config.model, device="meta"), [range(0, 3), range(3, 5)], seed=0,
                                 rule=rule):
            x = stage(x)
        torch.testing.assert_close(x, ref, atol=1e-5, rtol=0)
        again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        torch.testing.assert_close(again(idx).logits, ref, atol=1e-5, rtol=0)


@pytest.mark.pure
def test_unknown_moe_layout_is_one_line(compose):
    with pytest.raises(Exception) as err:
        compose(["mode=export", "model=moe-tiny", "export.moe_layout=stacked"])
    assert "export.moe_layout must be per_expert or fused (got 'stacked')" in str(err.value)
