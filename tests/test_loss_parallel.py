"""The vocab-parallel cross-entropy (parallel/loss_parallel.py) on 2 real gloo ranks (tp=2), and
what the planner makes of it (pure).

  - the loss and the logits' gradient equal F.cross_entropy's of the whole logits within 1e-6
    (fp32; ignored targets among them), and under bf16 autocast as torch's own fp32 loss;
  - a llama last stage (a block and the head) at tp=2, with and without sequence parallel: every
    tensor its forward, loss and backward create is recorded (a dispatch mode, the real ops run)
    and none has the vocabulary V on its last dimension, while the stage's loss and input gradient
    equal the unsplit stage's;
  - the tp cost model's head runs N-sized all-reduces, not an (N, V) all-gather, and each tp rank
    keeps and frees 1/tp of the loss's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from _dist import spawn
from pipetrain.parallel.loss_parallel import vocab_parallel_cross_entropy
from pipetrain.parallel.tp import TPGroup

V = 16  # a vocabulary split in 2
LLAMA = dict(vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_scaling=None)  # V = 1000: no other size


def batch(seed: int, vocab: int, shape=(3, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V) logits and (B, T) targets with 4 ignored (-1), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * 4
    target = torch.randint(0, vocab, shape, generator=g)
    target.view(-1)[torch.randperm(target.numel(), generator=g)[:4]] = -1
    return logits, target


def losses(rank: int, world: int, out: Path) -> None:
    g = TPGroup(None, world, rank)
    cols = slice(rank * V // world, (rank + 1) * V // world)
    res = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        logits, target = batch(0, V)
        local = logits[..., cols].to(dtype).requires_grad_()  # (B, T, V/tp): the head's output
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = vocab_parallel_cross_entropy(local, target, g)
        loss.backward()
        res[name] = (loss.detach(), local.grad)
    torch.save(res, out / f"loss{rank}.pt")


@pytest.mark.dist
def test_vocab_parallel_loss_and_gradient_equal_the_whole_cross_entropy(tmp_path):
    spawn(losses, 2, tmp_path)
    ranks = [torch.load(tmp_path / f"loss{r}.pt") for r in range(2)]
    for name, dtype, tol in (("fp32", torch.float32, 1e-6), ("bf16", torch.bfloat16, 1e-6)):
        logits, target = batch(0, V)
        whole = logits.to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            ref = F.cross_entropy(whole.view(-1, V), target.view(-1), ignore_index=-1)  # fp32 under autocast too
        ref.backward()
        for r, res in enumerate(ranks):
            loss, grad = res[name]
            assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < tol, (name, loss, ref)
            assert grad.dtype == dtype
            want = whole.grad[..., r * V // 2:(r + 1) * V // 2]
            # bf16: both round the same fp32 gradient to bf16; sums in another order may land one step apart
            torch.testing.assert_close(grad, want, rtol=0 if dtype == torch.float32 else 8e-3, atol=tol)
            assert grad.view(-1, V // 2)[target.view(-1) == -1].abs().max() == 0  # ignored tokens: no gradient


@pytest.mark.pure
def test_one_rank_is_the_plain_cross_entropy():
    logits, target = batch(1, 7)  # an odd vocabulary: a one-rank group splits nothing
    got = vocab_parallel_cross_entropy(logits, target, TPGroup(None, 1, 0))
    assert abs(got.item() - F.cross_entropy(logits.view(-1, 7), target.view(-1), ignore_index=-1).item()) < 1e-6
    assert vocab_parallel_cross_entropy(logits, torch.full_like(target, -1), TPGroup(None, 1, 0)).isnan()


class Shapes(TorchDispatchMode):
    """The shape of every tensor each op dispatched inside the `with` returns (the ops run for real)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def last_stage(rank: int, world: int, out: Path) -> None:
    """Forward, loss and backward of llama's last stage (a block and the head) at tp=2, SP off and on,
    every created tensor's shape recorded; and the unsplit stage's loss and input gradient."""
    from pipetrain.models.llama import Llama
    from pipetrain.models.split import split_model
    from pipetrain.parallel.tp_plan import parallelize_stage
    from pipetrain.runtime.step_result import SavedBytes

    model = Llama(seed=0, **LLAMA)
    bounds = [range(0, 2), range(2, 4)]
    x, target = batch(2, 32, shape=(2, 8))[0], batch(3, LLAMA["vocab_size"], shape=(2, 8))[1]  # (B, T, C), (B, T)
    res = {}
    for sp in (False, True):
        whole = split_model(model, bounds)[1]
        stage = parallelize_stage(split_model(model, bounds)[1], TPGroup(None, world, rank, sequence_parallel=sp))
        mine = (x[:, rank * 4:(rank + 1) * 4] if sp else x).clone().requires_grad_()  # SP: this rank's T/tp
        rec, saved = Shapes(), SavedBytes()
        with rec:
            logits = stage(mine)
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):  # what the loss keeps
                loss = stage.loss(logits, target)
            loss.backward()
        ref_x = x.clone().requires_grad_()
        ref = whole.loss(whole(ref_x), target)
        ref.backward()
        want = ref_x.grad[:, rank * 4:(rank + 1) * 4] if sp else ref_x.grad
        res[sp] = {"shapes": rec.shapes, "loss": (loss.item(), ref.item()), "grad": (mine.grad, want),
                   "loss_saved": saved.bytes}
    torch.save(res, out / f"stage{rank}.pt")


@pytest.mark.dist
def test_no_tp_rank_allocates_the_whole_logits(tmp_path):
    from pipetrain.models.llama import Llama
    from pipetrain.models.profile import loss_saved_bytes_per_token
    from pipetrain.planner.memory import loss_rank_bytes

    spawn(last_stage, 2, tmp_path)
    v = LLAMA["vocab_size"]
    # the planner's bytes for one tp rank's loss: the whole loss's, measured, over tp
    predicted = loss_rank_bytes(loss_saved_bytes_per_token(Llama(**LLAMA), seq=8), tokens=16, tp=2)
    for r in range(2):
        for sp, res in torch.load(tmp_path / f"stage{r}.pt").items():
            made = [shape for _, shape in res["shapes"]]
            assert (2, 8, v // 2) in made, "the head's (B, T, V/tp) logits: the recording sees the head"
            whole = [(op, shape) for op, shape in res["shapes"] if shape and shape[-1] == v]
            assert not whole, (sp, whole[:3])
            assert abs(res["loss"][0] - res["loss"][1]) < 1e-6, (sp, res["loss"])
            torch.testing.assert_close(*res["grad"], rtol=1e-5, atol=1e-6)
            # kept: the (16, V/2) fp32 softmax and the int64 targets (the targets' 8 B a token whole)
            assert res["loss_saved"] == 16 * (v // 2 * 4 + 8) == pytest.approx(predicted, rel=0.01)


@pytest.mark.pure
def test_tp_cost_head_runs_the_loss_all_reduces_not_a_logits_gather():
    """The head's F under tp: its compute / tp plus 2 all-reduces of N and 2N fp32 values, whatever V."""
    from pipetrain.partition.costs import LayerCost
    from pipetrain.schedules.reduce_cost import ring_factor
    from pipetrain.schedules.tp_cost import collectives, tp_layer_costs

    head = [LayerCost("head", 2.0, 2.0, 2.0, params=500, activation_bytes_per_token=100)]
    kw = dict(tp=4, tokens=4096, hidden=4096, bytes_per_value=2, bandwidth_gbs=1.0, latency_ms=0.1)
    small, llama3 = (tp_layer_costs(head, vocab=v, **kw)[0] for v in (512, 128256))
    loss_ms = 2 * 0.1 + ring_factor(4, all_reduce=True) * 4096 * 3 * 4 / 1e9 * 1e3  # 0.27 ms
    assert small.f_ms == llama3.f_ms == pytest.approx(2.0 / 4 + loss_ms)
    assert collectives("head") == (2, 1)  # F: the loss's 2; B: the head input's gradient all-reduce


@pytest.mark.pure
def test_loss_rank_bytes_split_over_tp():
    from pipetrain.planner.memory import loss_rank_bytes

    whole = loss_rank_bytes(4 * 128256 + 8, tokens=4096, tp=1)
    assert whole == pytest.approx(2.1e9, rel=0.01)  # Llama 3's fp32 logits of a 4,096-token row
    assert [loss_rank_bytes(4 * 128256 + 8, tokens=4096, tp=t) / whole for t in (2, 4, 8)] == [1 / 2, 1 / 4, 1 / 8]


@pytest.mark.pure
def test_planner_counts_a_tp_ranks_share_of_the_loss():
    """The last rank's predicted activations grow by 1/tp of the loss's logits per vocabulary entry,
    and its loss backward's bytes are 1/tp of tp=1's."""
    from pipetrain.compose import compose_config
    from pipetrain.planner.cmd import make_rows

    base = ["mode=plan", "model=gpt2-tiny", "data.seq_len=32", "data.batch_size=8", "plan.world_size=4",
            "plan.schedules=[1f1b]", "plan.microbatch_sizes=[1]", "plan.prune=false", "plan.memory_gb=1",
            "plan.pp=[2]"]

    def last_rank(vocab: int, tp: int):
        rows, _ = make_rows(compose_config([*base, f"model.vocab_size={vocab}", f"plan.tp=[{tp}]"]))
        return rows[0].memory[-1]

    # 1F1B's last rank holds 1 microbatch of 32 tokens; a vocabulary 8192 larger: 4 B of fp32 logits each
    grown = last_rank(16384, 2).activations - last_rank(8192, 2).activations
    assert grown == pytest.approx(32 * 4 * 8192 / 2)
    assert last_rank(8192, 2).loss_grad == pytest.approx(last_rank(8192, 1).loss_grad / 2)
