"""Multi-token prediction (model.mtp, DeepSeek-V3 §2.2: models/mtp.py).

Pure: the head layer's loss equals a plain-torch reading of §2.2 written here (depth k: enorm of the
embedding of the tokens k ahead and hnorm of the previous depth's hidden state, concatenated, eh_proj,
one block, the depth's own norm and the shared lm_head; L = L_main + lambda / D sum_k L_k), values and
gradients; train/loss is L_main's value; the executor at pp=1 trains as the one-process model and reports
mtp/loss_k; costs and parameter counts count the MTP depths on the head's layer; bad knobs refused in one
line. Dist (real gloo ranks): pp=2 under 1f1b (MTP on the last rank) and dualpipev (on rank 0, beside the
embedding) equal the one-process model for 3 steps within 1e-6 (losses, per-depth losses, parameters).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from _dist import spawn
from pipetrain.config.llama import LlamaModelConfig
from pipetrain.models.factory import build_model
from pipetrain.models.llama import hf_name, pipetrain_name
from pipetrain.models.llama_costs import llama_layer_costs, llama_param_count
from pipetrain.partition.uniform import uniform_bounds
from pipetrain.schedules import registry
from pipetrain.train.pipeline import Transport, build_rank_pipeline

REPO = Path(__file__).resolve().parents[1]
M, MB, SEQ, STEPS, LR, D, LAMBDA = 4, 2, 16, 3, 0.1, 2, 0.3


def knobs(*, tied: bool = False, depth: int = D, **more) -> dict:
    """llama-tiny at 2 blocks, width 64, with model.mtp.depth = `depth`."""
    raw = yaml.safe_load((REPO / "conf/model/llama-tiny.yaml").read_text())
    raw.pop("defaults")
    raw.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=128,
               tie_word_embeddings=tied, mtp={"depth": depth, "loss_weight": LAMBDA}, **more)
    return LlamaModelConfig(**raw).knobs()


def batches(model, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [model.example_batch(microbatch=MB, seq=SEQ, generator=g) for _ in range(M)]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def paper_loss(model, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """§2.2 in plain torch over the model's weights: (L_main + lambda / D sum_k L_k, [L_k])."""
    h = x
    for layer in list(model.layers)[:-1]:
        h = layer(h)  # (B, T, C): the main model's last hidden state, before the final norm
    head = model.layers[-1]
    emb, out = model.layers[0].embed_tokens.weight, head.lm_head.weight
    ce = lambda logits, t: F.cross_entropy(logits.reshape(-1, logits.size(-1)), t.reshape(-1))  # noqa: E731
    main = ce(F.linear(rms(h, head.norm.weight), out), y)
    t, parts = x.size(1), []
    for k, depth in enumerate(head.mtp, start=1):
        e = rms(F.embedding(x[:, k:], emb), depth.enorm.weight)  # Emb(t_{i+k}), i = 0..T-k-1
        h = depth.block(F.linear(torch.cat([e, rms(h[:, : t - k], depth.hnorm.weight)], -1), depth.eh_proj.weight))
        parts.append(ce(F.linear(rms(h, depth.shared_head.norm.weight), out), y[:, k:]))  # target t_{i+k+1}
    return main + LAMBDA / len(parts) * sum(parts), parts


@pytest.mark.pure
@pytest.mark.parametrize("tied", [False, True])
def test_head_loss_is_the_papers_objective(tied):
    model = build_model("llama", **knobs(tied=tied))
    x, y = batches(model, 0)[0]
    got = model.layers[-1].layer_loss(model(x), y, x)  # (1 + D,): main (carrying the MTP gradient), L_1..L_D
    reported = torch.autograd.grad(got[1:].sum(), list(model.parameters()), allow_unused=True, retain_graph=True)
    assert all(g is None or not g.any() for g in reported)  # the reported parts carry no gradient
    grads = torch.autograd.grad(got[0], list(model.parameters()))
    want, parts = paper_loss(model, x, y)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    main = F.cross_entropy(model(x)[..., :128].reshape(-1, 128), y.reshape(-1))
    assert got.shape == (1 + D,) and got[0].item() == pytest.approx(main.item(), abs=1e-6)  # L_main's value
    torch.testing.assert_close(got[1:], torch.stack(parts).detach(), atol=1e-6, rtol=0)
    assert got[1].item() != got[2].item()  # two depths, two different targets
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


@pytest.mark.pure
def test_the_loss_weight_scales_the_mtp_gradient_only():
    """lambda = 0 leaves the main gradient; the difference to lambda > 0 is lambda / D x the MTP terms'."""
    zero, some = (build_model("llama", **knobs()) for _ in range(2))
    zero.layers[-1].mtp.loss_weight = 0.0
    x, y = batches(zero, 0)[0]
    g0 = torch.autograd.grad(zero.layers[-1].layer_loss(zero(x), y, x)[0], list(zero.parameters()))
    out = some.layers[-1].layer_loss(some(x), y, x)
    g1 = torch.autograd.grad(out[0], list(some.parameters()))
    _, parts = paper_loss(some, x, y)
    g_mtp = torch.autograd.grad(sum(parts), list(some.parameters()), allow_unused=True)
    for a, b, c in zip(g0, g1, g_mtp):
        torch.testing.assert_close(b - a, LAMBDA / D * (torch.zeros_like(a) if c is None else c), atol=1e-6, rtol=0)


def train(rp, model) -> tuple[list[float], list[tuple[float, ...]]]:
    opt = torch.optim.SGD(rp.parameters(), lr=LR, momentum=0.9)
    losses, parts = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses.append(rp.train_step(batches(model, step)).loss)
        parts.append(rp.executor.step_loss.part_means)
        opt.step()
    return losses, parts


def reference(kn: dict):
    model = build_model("llama", **kn)
    opt = torch.optim.SGD(list(model.parameters()), lr=LR, momentum=0.9)
    losses, parts = [], []
    for step in range(STEPS):  # the mean over microbatches, as the executor's
        opt.zero_grad(set_to_none=True)
        out = torch.stack([model.layers[-1].layer_loss(model(x), y, x) for x, y in batches(model, step)]).mean(0)
        out[0].backward()
        losses.append(out[0].item())
        parts.append(tuple(out[1:].tolist()))
        opt.step()
    return losses, parts, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.pure
@pytest.mark.slow
def test_pp1_executor_trains_as_the_one_process_model():
    kn = knobs()
    with torch.device("meta"):
        model = build_model("llama", **kn)
    rp = build_rank_pipeline(model, [range(len(model.layers))], registry.build("1f1b", 1, M, 1), 0,
                             microbatch_size=MB, seq_len=SEQ, seed=0)
    losses, parts = train(rp, model)
    want_losses, want_parts, params = reference(kn)
    assert losses == pytest.approx(want_losses, abs=1e-6)
    assert [p for ps in parts for p in ps] == pytest.approx([p for ps in want_parts for p in ps], abs=1e-6)
    for _, n, p in rp.named_parameters():
        torch.testing.assert_close(p, params[n], atol=1e-6, rtol=0, msg=n)


def train_ranks(rank: int, world: int, out, kn: dict, names: list[str]) -> None:
    results = {}
    for name in names:
        with torch.device("meta"):
            model = build_model("llama", **kn)
        sched = registry.build(name, world, M, registry.get(name).fixed_stages_per_rank or 1)
        rp = build_rank_pipeline(model, uniform_bounds(len(model.layers), sched.placement.num_chunks), sched, rank,
                                 microbatch_size=MB, seq_len=SEQ, seed=0, transport=Transport(timeout_s=60))
        losses, parts = train(rp, model)
        results[name] = {"losses": losses, "parts": parts, "mtp_stages": [s for s, st in rp.stages.items()
                                                                          if st.loss_reads_inputs],
                         "params": [(n, p.detach().clone()) for _, n, p in rp.named_parameters()]}
        rp.close()
    torch.save(results, out / f"rank{rank}.pt")


@pytest.mark.dist
@pytest.mark.slow
def test_pp2_and_dualpipev_train_as_the_one_process_model(tmp_path):
    kn = knobs()
    spawn(train_ranks, 2, tmp_path, kn, ["1f1b", "dualpipev"])
    losses, parts, params = reference(kn)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # where the MTP module runs: the last stage, on the last rank under 1f1b and on rank 0 under dualpipev
    assert [per_rank[r]["1f1b"]["mtp_stages"] for r in range(2)] == [[], [1]]
    assert [per_rank[r]["dualpipev"]["mtp_stages"] for r in range(2)] == [[3], []]
    for name in ("1f1b", "dualpipev"):
        seen = set()
        for r in range(2):
            got = per_rank[r][name]
            assert got["losses"] == pytest.approx(losses, abs=1e-6), (name, r)
            flat = [p for ps in got["parts"] for p in ps]
            assert flat == pytest.approx([p for ps in parts for p in ps], abs=1e-6), (name, r)
            for n, p in got["params"]:
                torch.testing.assert_close(p, params[n], atol=1e-6, rtol=0, msg=f"{name} rank {r} {n}")
                seen.add(n)
        assert seen == set(params)  # the MTP's embedding and head copies included


@pytest.mark.pure
@pytest.mark.parametrize("tied", [False, True])
def test_costs_and_counts_hold_the_mtp_depths_on_the_head(tied):
    kn = knobs(tied=tied)
    with torch.device("meta"):
        model = build_model("llama", **kn)
    costs = llama_layer_costs(model.config, microbatch=MB, seq=SEQ, tflops=1.0)
    plain = llama_layer_costs({**model.config, "mtp": {"depth": 0}}, microbatch=MB, seq=SEQ, tflops=1.0)
    assert costs[-1].name == f"head+mtp{D}" and [c.name for c in costs[:-1]] == [c.name for c in plain[:-1]]
    block = plain[-2]
    assert costs[-1].flops_per_token > plain[-1].flops_per_token + D * block.flops_per_token
    assert costs[-1].params == sum(p.numel() for p in model.layers[-1].parameters())  # copies stored there too
    assert llama_param_count(model.config) == sum(p.numel() for p in model.parameters())


@pytest.mark.pure
def test_mtp_parameters_map_to_hugging_face_deepseek_v3_keys():
    with torch.device("meta"):
        model = build_model("llama", **knobs())
    n = 2
    for name, _ in model.named_parameters(remove_duplicate=False):
        key = hf_name(name, num_hidden_layers=n)
        assert pipetrain_name(key, num_hidden_layers=n, mtp_depth=D) == name
    assert hf_name("layers.3.mtp.1.block.self_attn.q_proj.weight", num_hidden_layers=n) == \
        "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("layers.3.mtp.0.shared_head.head.weight", num_hidden_layers=n) == \
        "model.layers.2.shared_head.head.weight"


@pytest.mark.pure
@pytest.mark.parametrize("overrides, message", [
    (["model.mtp.depth=8", "data.seq_len=8"], "model.mtp.depth=8 needs rows longer than 8 tokens (depth k predicts "
                                              "at the first T - k positions of a row), but data.seq_len=8: set "
                                              "model.mtp.depth < 8"),
    (["model.mtp.depth=-1"], "model.mtp.depth must be an integer >= 0 (got -1): 0 turns MTP off"),
    (["model.mtp.loss_weight=-0.5"], "model.mtp.loss_weight must be a finite number >= 0 (got -0.5)"),
    (["model.mtp.depth=1", "parallel.tp=2"], "model.mtp.depth=1 with parallel.tp=2 is not supported yet"),
    (["model.mtp.depth=1", "trainer.compile=true"], "model.mtp.depth=1 with trainer.compile=true is not supported "
                                                    "yet"),
    (["model=gpt2-tiny", "model.mtp.depth=1"], "model.mtp.depth=1: GPT-2 has no multi-token prediction module"),
])
def test_bad_mtp_knobs_fail_in_one_line_at_composition(compose, overrides, message):
    base = ["model=llama-tiny"] if not overrides[0].startswith("model=") else []
    with pytest.raises(ValueError) as err:
        compose([*base, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)
