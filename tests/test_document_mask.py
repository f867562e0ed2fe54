"""Document masks (issue #46): a packed row computes what each of its documents computes alone.

`documents(ids, eos)` (runtime/documents.py) over its edge cases; then llama-tiny (GQA, RoPE) and GPT-2
(learned positions) in one process: the logits of a packed row of several documents equal each document
run alone within 1e-5, through the executor's step (whole stages, activation recompute, node by node)
and its evaluate() (mode=eval's forward), the step's gradients those of the documents' losses; without
document masks the executor is the causal model bit for bit. The config resolves data.document_mask and
refuses it in one line where it cannot hold. Across processes (pp=2, tp=2): test_document_mask_dist.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipetrain.models.factory import build_model
from pipetrain.models.llama import Llama
from pipetrain.parallel.parallelize import Parallelize
from pipetrain.runtime.documents import Documents, block_causal, documents
from pipetrain.schedules import registry
from pipetrain.train.pipeline import build_rank_pipeline

pytestmark = pytest.mark.pure

EOS, BOS = 3, 2
M, MB, SEQ = 2, 2, 24


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def test_documents_start_at_zero_and_after_every_eos():
    d = documents(ids([5, 6, EOS, 7, 8, 9, EOS, 4]), EOS)
    assert d.index.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert d.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


@pytest.mark.parametrize("row, index, positions", [
    ([5, 6, 7, 8], [0, 0, 0, 0], [0, 1, 2, 3]),  # no EOS: one document (a row cut mid-document too)
    ([5, 6, 7, EOS], [0, 0, 0, 0], [0, 1, 2, 3]),  # EOS at the end ends the row's only document
    ([EOS, EOS, 5, EOS], [0, 1, 2, 2], [0, 0, 0, 1]),  # consecutive EOS: documents of one token
    ([5, EOS, BOS, 6, EOS, BOS], [0, 0, 1, 1, 1, 2], [0, 1, 0, 1, 2, 0]),  # BOS opens the document after EOS
])
def test_documents_edge_cases(row, index, positions):
    d = documents(ids(row), EOS)
    assert d.index.tolist() == [index] and d.positions.tolist() == [positions]


def test_rows_are_cut_independently_and_the_mask_is_block_causal():
    d = documents(ids([5, EOS, 6, 7], [EOS, 8, 9, 4]), EOS)
    assert d.index.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    mask = block_causal(d.index)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]]
    built = d.with_mask()
    assert built.with_mask() is built and torch.equal(built.attention_mask(), mask)


def test_floats_are_refused_in_one_line():
    with pytest.raises(ValueError, match="token ids"):
        documents(torch.zeros(2, 4), EOS)


# ---- one process: packed rows equal their documents alone ---------------------------------------------


def make(name: str) -> torch.nn.Module:
    """Seed 0 (init.py): the same weights whether built whole or cut into stages."""
    if name == "llama":
        return Llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
    return build_model("gpt2-tiny", n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=64, dropout=0.0)


def packed_microbatches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """M microbatches of packed rows cut from one stream of documents of 1..9 tokens ending in EOS (a row
    starts and ends mid-document), targets the next token."""
    g = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    while len(stream) < M * MB * (SEQ + 1):
        stream += [*torch.randint(4, 64, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g).tolist(), EOS]
    rows = torch.tensor(stream[:M * MB * (SEQ + 1)]).view(M, MB, SEQ + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]


def alone(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, T, V): each document of each row run by itself, its logits put back where it sits in the row."""
    d = documents(x, EOS)
    out = []
    for b in range(x.size(0)):
        parts = [model(x[b:b + 1, d.index[b] == i]) for i in range(int(d.index[b].max()) + 1)]
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out)


def capture_logits(rp) -> list[torch.Tensor]:
    """The last stage's logits of every microbatch, in the order its losses run (the loss is the model's)."""
    (last,) = [s for s in rp.stages.values() if s.is_last]
    seen: list[torch.Tensor] = []
    loss = last.loss_fn

    def keep(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(out.detach().clone())
        return loss(out, target)

    last.set_loss(keep)
    return seen


def pipeline(model, *, recompute: bool = False, fb_overlap: str = "off", eos: int | None = EOS):
    sched = registry.build("1f1b", 1, M, 1)
    rp = build_rank_pipeline(model, [range(len(model.layers))], sched, 0, microbatch_size=MB, seq_len=SEQ,
                             parallelize=Parallelize(recompute=recompute), fb_overlap=fb_overlap)
    rp.executor.batch.document_eos = eos
    return rp


def reference(name: str, mbs) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], float]:
    """Per microbatch the documents' logits alone; the gradients and loss of their mean cross-entropy / M."""
    model = make(name)
    logits, losses = [], []
    for x, y in mbs:
        out = alone(model, x)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        (loss / M).backward()
        logits.append(out.detach())
        losses.append(loss.item())
    return logits, {n: p.grad for n, p in model.named_parameters()}, sum(losses) / M


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("how", ["whole", "recompute", "nodes"])
def test_a_packed_row_gives_each_documents_logits_and_gradients(name, how):
    mbs = packed_microbatches()
    ref_logits, ref_grads, ref_loss = reference(name, mbs)
    rp = pipeline(make(name), recompute=how == "recompute", fb_overlap="serial" if how == "nodes" else "off")
    seen = capture_logits(rp)
    res = rp.train_step(mbs)
    assert len(seen) == M
    for got, want in zip(seen, ref_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert res.loss == pytest.approx(ref_loss, abs=1e-5)
    for _, n, p in rp.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_eval_with_document_masks_is_each_documents_loss(name):
    """mode=eval's forward (Executor.evaluate): the same logits, the mean over every target."""
    mbs = packed_microbatches(1)
    ref_logits, _, ref_loss = reference(name, mbs)
    rp = pipeline(make(name))
    seen = capture_logits(rp)
    loss = rp.executor.evaluate(mbs)
    for got, want in zip(seen, ref_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert loss == pytest.approx(ref_loss, abs=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_without_document_masks_the_rows_stay_causal_bit_for_bit(name):
    """document_eos None: no Documents reach the stages (SDPA's is_causal path), the unsplit model's logits
    exactly; with masks a row without EOS is that same one document (within fp32 rounding)."""
    mbs = packed_microbatches(2)
    model = make(name)
    for eos, exact in ((None, True), (63 + 1, False)):  # 64: an id no row holds
        rp = pipeline(make(name), eos=eos)
        seen = capture_logits(rp)
        rp.executor.evaluate(mbs)
        for got, (x, _) in zip(seen, mbs):
            with torch.no_grad():
                want = model(x)
            if exact:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_stage_builds_the_mask_once_for_its_layers():
    """StageModule.forward hands the layers that read documents one Documents with the mask built."""
    model = make("llama")
    rp = pipeline(model)
    (stage,) = rp.stages.values()
    got = []
    for layer in stage.layers.values():
        layer.register_forward_pre_hook(lambda _m, args: got.append(args[1] if len(args) > 1 else None))
    x = packed_microbatches()[0][0]
    stage(x, documents(x, EOS))
    embed, *blocks, head = got
    assert embed is None and head is None  # llama's embedding and head read no documents
    assert all(isinstance(d, Documents) and d.mask is not None for d in blocks)
    assert all(d is blocks[0] for d in blocks)


# ---- config: resolved default, one-line refusals ------------------------------------------------------


def refused(compose, overrides: list[str]) -> str:
    with pytest.raises(Exception) as info:
        compose(overrides)
    err = info.value
    while err.__cause__ is not None:
        err = err.__cause__
    assert isinstance(err, ValueError) and "\n" not in str(err), err
    return str(err)


def test_document_mask_defaults_on_for_packed_datasets_and_is_refused_where_it_cannot_hold(compose, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello pipeline world.\n" * 2000)
    ds = ["data=datasets", f"data.path={text}"]
    assert compose([*ds, "model=llama-tiny"]).data.masks_documents
    assert not compose([*ds, "model=llama-tiny", "data.packing=false"]).data.masks_documents
    assert not compose([*ds, "model=llama-tiny", "data.document_mask=false"]).data.masks_documents
    assert not compose(["model=llama-tiny"]).data.masks_documents  # the built-in corpus: no documents
    assert "data.document_mask=false" in refused(compose, ["model=llama-tiny", "data.document_mask=true"])
    assert compose([*ds, "model=llama-tiny", "parallel.cp=2", "data.seq_len=64"]).data.masks_documents  # cp: #46
    assert "trainer.compile=false" in refused(compose, [*ds, "model=llama-tiny", "trainer.compile=true"])
    assert "no attention" in refused(compose, [*ds, "model=mlp", "data.document_mask=true", "mode=simulate"])
