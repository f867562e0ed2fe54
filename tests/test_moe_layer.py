"""The MoE layer (pipetrain/models/moe.py, moe_router.py) against references written here and
against transformers' own MoE blocks: routing (softmax / sigmoid, renormalisation, scale,
DeepSeek's group limit, the choice-only bias), experts, shared experts, capacity, balance losses,
the aux-free bias update, and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipetrain.config.moe import MoEConfig
from pipetrain.models.moe import MoE, dispatch
from pipetrain.models.moe_router import balance_loss, updated_expert_bias

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: with two intra-op threads on busy cores a 256 x 8 matmul spent 15 ms of
    CPU in OpenMP's barrier (measured) against 4 us on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


H, I = 8, 16  # hidden, expert width: multiples of 8, as experts_impl=grouped needs
STD = 0.2  # initial weights: outputs of order 0.1, where 1e-6 is about ten fp32 ulps


def make_moe(seed: int = 0, *, hidden: int = H, intermediate: int = I, bias: bool = False,
             shared_intermediate=None, **knobs) -> MoE:
    moe = MoE(MoEConfig(**knobs), hidden=hidden, intermediate=intermediate, shared_intermediate=shared_intermediate)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            if p.requires_grad:  # not the router's expert_bias (a parameter without gradient)
                p.normal_(0.0, STD, generator=g)
        if bias:
            moe.router.expert_bias.normal_(0.0, 0.1, generator=g)
    return moe


def swiglu(x, w1, w3, w2):
    return w2 @ (torch.nn.functional.silu(w1 @ x) * (w3 @ x))


@torch.no_grad()
def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, with the routing written out from the formulas
    (DeepSeek-V3 §2.1.2 and its inference code for the group limit) and Python's own sorting."""
    c, r, ex = moe.config, moe.router, moe.experts
    flat = x.reshape(-1, x.shape[-1])
    per_group = c.num_experts // c.n_group
    routed = []  # per token: [(expert, gate)]
    for xt in flat:
        logits = r.weight @ xt
        s = torch.softmax(logits, 0) if c.score_func == "softmax" else torch.sigmoid(logits)
        b = [float(s[e].detach() + r.expert_bias[e]) for e in range(c.num_experts)]
        group_score = [sum(sorted(b[g * per_group:(g + 1) * per_group])[-2:]) for g in range(c.n_group)]
        groups = sorted(range(c.n_group), key=lambda g: -group_score[g])[: c.topk_group]
        allowed = [e for e in range(c.num_experts) if e // per_group in groups]
        chosen = sorted(allowed, key=lambda e: -b[e])[: c.top_k]
        if c.force_balanced:  # round-robin over the flattened (token, k) assignments
            chosen = [(len(routed) * c.top_k + k) % c.num_experts for k in range(c.top_k)]
        gates = [s[e] for e in chosen]
        total = sum(gates) if c.norm_topk_prob else 1.0
        routed.append([(e, g / total * c.routed_scaling_factor) for e, g in zip(chosen, gates)])
    kept = {(t, e) for t, pairs in enumerate(routed) for e, _ in pairs}
    if c.capacity_factor is not None:  # each expert keeps its ceil(c T K / E) highest gates, earlier token first
        cap = math.ceil(c.capacity_factor * len(routed) * c.top_k / c.num_experts)
        kept = set()
        for e in range(c.num_experts):
            mine = sorted((-float(g), t) for t, pairs in enumerate(routed) for ee, g in pairs if ee == e)
            kept |= {(t, e) for _, t in mine[:cap]}
    out = []
    for t, xt in enumerate(flat):
        y = sum((g * swiglu(xt, ex.w1[e], ex.w3[e], ex.w2[e]) for e, g in routed[t] if (t, e) in kept),
                torch.zeros_like(xt))
        if moe.shared_experts is not None:
            sh = moe.shared_experts
            z = swiglu(xt, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
            y = y + (z if sh.gate is None else torch.sigmoid(sh.gate.weight @ xt) * z)
        out.append(y)
    return torch.stack(out).view(x.shape)


CASES = {
    "softmax-renorm": dict(score_func="softmax", norm_topk_prob=True),
    "softmax-raw": dict(score_func="softmax", norm_topk_prob=False, top_k=3),
    "sigmoid-renorm-scaled": dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "sigmoid-raw": dict(score_func="sigmoid", norm_topk_prob=False),
    "softmax-shared": dict(score_func="softmax", num_shared_experts=2),
    "deepseek-groups-bias-gated-shared": dict(score_func="sigmoid", num_experts=8, top_k=3, n_group=4, topk_group=2,
                                              routed_scaling_factor=2.5, bias=True, num_shared_experts=1,
                                              shared_gate=True),
    "capacity": dict(score_func="softmax", capacity_factor=0.75, num_shared_experts=1),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", CASES)
def test_layer_equals_per_token_reference(case):
    moe = make_moe(1, **CASES[case])
    x = torch.randn(2, 6, H, generator=torch.Generator().manual_seed(2))
    got = moe(x).out
    assert got.shape == x.shape
    torch.testing.assert_close(got, reference(moe, x), rtol=0, atol=1e-6)


def load_hf_block(moe: MoE, block: nn.Module) -> None:
    """transformers 5 keeps experts fused: gate_up_proj (E, 2I, H) = cat([w1, w3], 1), down_proj = w2."""
    with torch.no_grad():
        moe.router.weight.copy_(block.gate.weight)
        w1, w3 = block.experts.gate_up_proj.chunk(2, dim=1)
        moe.experts.w1.copy_(w1), moe.experts.w3.copy_(w3), moe.experts.w2.copy_(block.experts.down_proj)
        if hasattr(block.gate, "e_score_correction_bias"):
            moe.router.expert_bias.copy_(block.gate.e_score_correction_bias)
        shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        if shared is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(moe.shared_experts, name).weight.copy_(getattr(shared, name).weight)
        if hasattr(block, "shared_expert_gate"):
            moe.shared_experts.gate.weight.copy_(block.shared_expert_gate.weight)


def hf_case(name: str):
    """(transformers block, our config knobs, intermediate, shared_intermediate) for one family."""
    if name.startswith("mixtral"):
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=4, num_experts_per_tok=2)
        return MixtralSparseMoeBlock(cfg), dict(num_experts=4, top_k=2), I, None
    if name.startswith("qwen3"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

        norm = name.endswith("norm")
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=6, num_experts_per_tok=3,
                             norm_topk_prob=norm)
        return Qwen3MoeSparseMoeBlock(cfg), dict(num_experts=6, top_k=3, norm_topk_prob=norm), I, None
    if name.startswith("qwen2"):
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock

        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=20,
                             num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
        knobs = dict(num_experts=6, top_k=2, norm_topk_prob=False, num_shared_experts=1, shared_gate=True)
        return Qwen2MoeSparseMoeBlock(cfg), knobs, I, 20
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=3,
                           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    knobs = dict(num_experts=8, top_k=3, score_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                 num_shared_experts=2)
    return DeepseekV3MoE(cfg), knobs, I, None


@pytest.mark.pure
@pytest.mark.parametrize("family", ["mixtral", "qwen3-norm", "qwen3-raw", "qwen2-shared-gated", "deepseek-v3"])
def test_matches_transformers_moe_blocks(family):
    pytest.importorskip("transformers")
    block, knobs, inter, shared = hf_case(family)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, STD, generator=g)
        if hasattr(block.gate, "e_score_correction_bias"):  # a trained-looking bias, so it matters
            block.gate.e_score_correction_bias.normal_(0.0, 0.1, generator=g)
    block.eval()
    moe = MoE(MoEConfig(**knobs), hidden=H, intermediate=inter, shared_intermediate=shared)
    load_hf_block(moe, block)
    x = torch.randn(2, 7, H, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).out, block(x), rtol=0, atol=1e-6)


@pytest.mark.pure
@pytest.mark.parametrize("norm", [False, True])
def test_bias_changes_the_choice_not_the_gates(norm):
    moe = make_moe(4, score_func="sigmoid", norm_topk_prob=norm)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(5))
    before = moe.router(x)
    rare = int(torch.bincount(before.ids.flatten(), minlength=8).argmin())
    moe.router.expert_bias[rare] = 10.0  # above any sigmoid gap: every token now picks `rare`
    after = moe.router(x)
    assert bool((after.ids == rare).any(-1).all()) and not bool((before.ids == rare).any(-1).all())
    torch.testing.assert_close(after.scores, before.scores, rtol=0, atol=0)
    raw = after.scores.gather(1, after.ids)  # the unbiased scores of the new choice
    want = raw / raw.sum(-1, keepdim=True) if norm else raw
    torch.testing.assert_close(after.gates, want, rtol=0, atol=1e-7)


# Hand-computed: 4 tokens, 2 experts, top-1. Tokens 0-2 pick expert 0, token 3 expert 1.
SCORES = torch.tensor([[0.75, 0.25], [0.75, 0.25], [0.75, 0.25], [0.25, 0.75]])
IDS = torch.tensor([[0], [0], [0], [1]])


@pytest.mark.pure
def test_balance_losses_on_a_hand_computed_case():
    # Batch: f = E/(K T) counts = 2/4 [3, 1] = [1.5, 0.5]; P = [2.5/4, 1.5/4]; sum f P = 0.9375 + 0.1875.
    assert balance_loss(SCORES, IDS, score_func="softmax").item() == pytest.approx(1.125, abs=1e-7)
    # Per sequence of 2: (0, 1): f = [2, 0], P = [.75, .25] -> 1.5; (2, 3): f = [1, 1], P = [.5, .5] -> 1.0.
    assert balance_loss(SCORES, IDS, score_func="softmax", seq_len=2).item() == pytest.approx(1.25, abs=1e-7)
    # Sigmoid scores are normalised over the experts first: doubling them changes nothing.
    assert balance_loss(2 * SCORES, IDS, score_func="sigmoid").item() == pytest.approx(1.125, abs=1e-7)
    even = torch.full((4, 2), 0.5)
    assert balance_loss(even, torch.tensor([[0], [1], [0], [1]]), score_func="softmax").item() == 1.0


@pytest.mark.pure
def test_aux_loss_is_k_times_smaller_than_transformers_mixtral_loss():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(20, 6, generator=torch.Generator().manual_seed(6))
    ids = logits.topk(2, dim=-1).indices
    ours = balance_loss(logits.softmax(-1), ids, score_func="softmax")
    theirs = load_balancing_loss_func((logits,), num_experts=6, top_k=2)  # counts not divided by K
    torch.testing.assert_close(2 * ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.pure
@pytest.mark.parametrize("balance", ["aux_loss", "seq_aux_loss"])
def test_aux_loss_gradient_reaches_the_router(balance):
    moe = make_moe(7, balance=balance, aux_loss_coef=0.01)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(8))
    result = moe(x)
    flat = x.reshape(-1, H)
    routing = moe.router(flat)
    want = 0.01 * balance_loss(routing.scores, routing.ids, score_func="softmax",
                               seq_len=5 if balance == "seq_aux_loss" else None)
    torch.testing.assert_close(result.aux_loss, want, rtol=0, atol=0)
    result.aux_loss.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad is None  # the loss reads only the router


@pytest.mark.pure
@pytest.mark.parametrize("balance", ["aux_free", "none"])
def test_no_aux_loss_without_an_aux_balance(balance):
    assert make_moe(balance=balance)(torch.randn(3, H)).aux_loss.item() == 0.0


@pytest.mark.pure
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_and_reports(factor):
    moe = make_moe(9, capacity_factor=factor, num_experts=4, top_k=2)
    x = torch.randn(3, 8, H, generator=torch.Generator().manual_seed(10))
    result = moe(x)
    cap = math.ceil(factor * 24 * 2 / 4)
    over = (result.tokens_per_expert - cap).clamp(min=0).sum().item()  # assignments past each expert's cap
    assert result.dropped_fraction.item() == pytest.approx(over / 48)
    torch.testing.assert_close(result.out, reference(moe, x), rtol=0, atol=1e-6)
    assert make_moe(9, num_experts=4)(x).dropped_fraction.item() == 0.0


@pytest.mark.pure
def test_force_balanced_routes_round_robin():
    moe = make_moe(11, num_experts=4, top_k=2, force_balanced=True)
    moe.router.expert_bias[0] = 10.0  # ignored: the choice is round-robin
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(12))
    result = moe(x)
    assert result.tokens_per_expert.tolist() == [5, 5, 5, 5]
    torch.testing.assert_close(result.out, reference(moe, x), rtol=0, atol=1e-6)


@pytest.mark.pure
def test_dispatch_is_expert_major_in_token_order():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])  # token t's k-th choice
    d = dispatch(ids, None, 3)
    assert d.counts.tolist() == [3, 2, 3]
    assert d.tokens.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert ids.reshape(-1)[d.slots].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    keep = torch.tensor([[True, True], [False, True], [True, True], [True, False]])
    d = dispatch(ids, keep, 3)
    assert d.counts.tolist() == [2, 2, 2] and d.tokens.tolist() == [0, 3, 1, 2, 0, 2]


@pytest.mark.pure
def test_backward_matches_finite_differences_in_float64():
    moe = make_moe(12, hidden=3, intermediate=2, num_experts=3, top_k=2, num_shared_experts=1, shared_gate=True,
                   balance="aux_loss").double()
    names = [n for n, _ in moe.named_parameters()]
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(13))

    def f(x, *params):
        result = torch.func.functional_call(moe, dict(zip(names, params)), (x,))
        return result.out, result.aux_loss

    inputs = (x.requires_grad_(), *(p.detach().requires_grad_() for p in moe.parameters()))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.pure
def test_grouped_experts_equal_the_loop_on_cpu():
    """F.grouped_mm's ATen fallback on CPU: the same maths as the CUDA kernel, not its speed."""
    loop, grouped = make_moe(14), make_moe(14, experts_impl="grouped")
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(15))
    a, b = loop(x).out, grouped(x).out
    torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    grad = torch.randn_like(a)
    a.backward(grad), b.backward(grad)
    for (name, p), q in zip(loop.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.pure
def test_grouped_experts_under_bf16_autocast_with_fp32_weights():
    """trainer.precision=bf16 keeps fp32 weights and autocasts, which leaves grouped_mm alone (its CUDA kernel
    takes bf16 only; on bf16 rows and fp32 weights even the CPU fallback raises): the experts cast both to
    autocast's dtype, as autocast does for the loop's matmuls. Same result as the loop; fp32 gradients."""
    loop, grouped = make_moe(14).experts, make_moe(14, experts_impl="grouped").experts
    counts = torch.zeros(loop.w1.shape[0], dtype=torch.long)
    counts[:4] = torch.tensor([3, 0, 5, 1])  # rows of 3 experts, one with none, the rest empty
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(15))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for rows in (x, x.bfloat16()):  # fp32 rows, and bf16 rows as an autocast op upstream leaves them
            a, b = loop(rows, counts), grouped(rows, counts)
            assert b.dtype == torch.bfloat16
            torch.testing.assert_close(b, a.to(b.dtype), rtol=2e-2, atol=2e-2)
    b.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in grouped.parameters())


@pytest.mark.gpu
def test_grouped_experts_on_cuda():
    """Not run in the CPU suite: the grouped-GEMM path on a CUDA GPU against the loop, in bf16."""
    loop = make_moe(16, hidden=64, intermediate=128).cuda().bfloat16()
    grouped = make_moe(16, hidden=64, intermediate=128, experts_impl="grouped").cuda().bfloat16()
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(grouped(x).out, loop(x).out, rtol=2e-2, atol=2e-2)


@pytest.mark.pure
def test_bias_update_on_a_hand_computed_case():
    counts = torch.tensor([5, 1, 2, 0])  # mean 2: expert 0 overloaded, 1 and 3 under, 2 even
    bias = torch.zeros(4)
    assert updated_expert_bias(bias, counts, rate=0.5).tolist() == [-0.5, 0.5, 0.0, 0.5]
    # centred: minus the update's mean, 0.125
    assert updated_expert_bias(bias, counts, rate=0.5, center=True).tolist() == [-0.625, 0.375, -0.125, 0.375]


@pytest.mark.pure
def test_aux_free_updates_even_out_a_skewed_router():
    moe = make_moe(17, num_experts=8, top_k=2)
    # Tokens sharing a common direction (mean 1 in every feature): the router starts with a few favourites.
    x = torch.randn(256, H, generator=torch.Generator().manual_seed(18)) + 1.0

    def counts() -> torch.Tensor:
        return torch.bincount(moe.router(x).ids.flatten(), minlength=8)

    imbalance = []  # max / mean tokens per expert, before each update
    for _ in range(200):
        now = counts()
        imbalance.append((now.max() / now.double().mean()).item())
        moe.router.expert_bias.copy_(updated_expert_bias(moe.router.expert_bias, now, rate=1e-2))
    assert imbalance[0] > 2.5 and max(imbalance[-50:]) < 1.3


@pytest.mark.pure
@pytest.mark.parametrize("knobs, knob", [
    (dict(balance="sinkhorn"), "model.moe.balance"),
    (dict(score_func="relu"), "model.moe.score_func"),
    (dict(top_k=9), "model.moe.top_k"),
    (dict(n_group=3), "model.moe.n_group"),
    (dict(n_group=8), "model.moe.n_group"),
    (dict(n_group=4, topk_group=5), "model.moe.topk_group"),
    (dict(topk_group=2), "model.moe.topk_group"),
    (dict(n_group=4, topk_group=1, top_k=3), "model.moe.top_k"),
    (dict(shared_gate=True), "model.moe.shared_gate"),
    (dict(capacity_factor=0.0), "model.moe.capacity_factor"),
    (dict(bias_update_rate=-1.0), "model.moe.bias_update_rate"),
    (dict(experts_impl="megablocks"), "model.moe.experts_impl"),
    (dict(num_shared_experts=-1), "model.moe.num_shared_experts"),
])
def test_config_errors_name_the_knob(knobs, knob):
    with pytest.raises(ValueError, match=knob.replace(".", r"\.")) as err:
        MoEConfig(**knobs)
    assert "\n" not in str(err.value)


@pytest.mark.pure
def test_grouped_experts_refuse_unaligned_widths():
    with pytest.raises(ValueError, match=r"model\.moe\.experts_impl=grouped needs .* divisible by 8"):
        make_moe(intermediate=12, experts_impl="grouped")


@pytest.mark.pure
@pytest.mark.slow
def test_a_compiled_moe_block_compiles_once_and_still_counts_its_forwards(compose, tmp_path, monkeypatch):
    """trainer.compile on an MoE model (1F1B: the block compiled, its stacked experts eager): no forward after the
    first two recompiles (torch's fail_on_recompile stance raises if one would: the block's forward counter was
    a guard that failed at every forward and the expert loop specialised on each routing's row counts, a
    compiled moe-tiny 1F1B step 9x eager's), and the statistics still count every training forward."""
    from pipetrain.parallel.parallelize import compile_layer
    from pipetrain.plan import build_model

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    block = build_model(compose(["model=moe-tiny"]).model).layers[1]
    width = block.mlp.experts.w1.shape[-1]
    compile_layer(block, apart=False)  # as trainer.compile under 1F1B

    def step() -> None:  # new tokens: another routing every time
        block(torch.randn(2, 16, width, requires_grad=True)).sum().backward()

    step(), step()
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(3):
            step()
    assert block.mlp.forwards == 5 and int(block.mlp.tokens_per_expert.sum()) == 5 * 2 * 16 * 2  # top-2
