"""How close a parallel run must come to its reference: the suite's error model for gradients.

Two runs of the same maths (tp's partial sums, an all-to-all's grouping of tokens, a dp mean, and
the CPU's own kernels: ATEN_CPU_CAPABILITY=avx512, avx2 and default block their reductions
differently) differ only in the order of floating-point additions. fp32 rounds each addition to
within U = 2**-24 of its result, so two orders of one sum differ by a few U times the size of the
terms summed, not of the sum (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 4).
Per optimizer step k, for each gradient tensor t of n_t elements:

    ||got_t - ref_t|| <= tau_k * (||ref_t|| + rms * sqrt(n_t))

- ||ref_t||: the tensor's own scale, which bounds its terms when they do not cancel.
- rms * sqrt(n_t): the tensor's share of the step's gradient (rms: the root mean square of the
  reference gradient's elements over all tensors compared). A tensor whose gradient cancels to far
  below that share carries errors of the size of its terms, and those are the step's size, not its
  own: a top-k router's rows for experts no token chose are exact zeros computed as differences of
  1e-14 (norm 9.5e-6 against 5e-2 for the step), a norm weight's gradient is a sum of +- terms.
- tau_k grows with the AdamW steps taken before step k, as the weights stop being equal:
  - tau_1 = 32 U (1.9e-6): both runs start from the same weights; only the step's own
    reassociation differs.
  - tau_2 = 256 U: AdamW's first update is lr * g / (|g| + eps), lr * sign(g) wherever |g| >> eps,
    so the weights differ only where a gradient element is near 0 (by up to lr * dg / eps).
  - tau_3 = 4096 U (2.4e-4): the second update divides two moments that mix both steps'
    gradients, so every element passes on its own relative difference (lr * dg_i / |g_i|, large
    where g_i is near 0), and step 3's forward and backward run on weights that differ that much.
  The bounds assume optim.eps=1e-6, as the parity tests' BASE sets (test_tensor_parallel.py says
  why): at AdamW's default 1e-8 the first update's lr * dg / eps is 100x larger, and step 2 of
  test_data_parallel measured 466 U.
  Measured (PIPETRAIN_PARITY_REPORT, every comparison of test_tensor_parallel, test_context_parallel,
  test_tp_3d, test_moe_ep and test_data_parallel, each with all processes under
  ATEN_CPU_CAPABILITY=avx512, avx2, default, default with MKL_CBWR=COMPATIBLE, and with the ranks
  under default against a reference on avx512): at most 9.5 U, 48 U and 844 U
  at steps 1-3 (the scalar `default` kernels sum with larger error than the vectorised ones:
  avx2 and avx512 alone stay within 205 U at step 3).

What it still catches: one layer's expert gradients scaled by 1.001 show as 431 U at step 1 against
tau_1's 32 U (tests/test_moe_ep.py plants it in every rank's record), and as 70x tau_1 in a real ep=2
run against one process; a token routed to another expert in every router forward shows as 3e4x tau_1.

Set PIPETRAIN_PARITY_REPORT=FILE to append each comparison's worst err / bound (JSON lines): how
close a run on this CPU comes to the bound.
"""

from __future__ import annotations

import json
import math
import os

import torch

U = 2.0 ** -24  # fp32's unit roundoff


TAU = (32 * U, 256 * U, 4096 * U)  # tau_k for optimizer steps 1, 2 and 3: above


def grad_tolerance(step: int) -> float:
    """tau_k for optimizer step k (1-based)."""
    if not 1 <= step <= len(TAU):
        raise ValueError(f"the error model covers steps 1-{len(TAU)}, not {step}: compare fewer steps")
    return TAU[step - 1]


def gradient_excess(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    """name -> ||got - ref|| / the bound, for every tensor of `got` (> 1: outside the error model)."""
    missing = set(got) - set(ref)
    assert got and not missing, f"step {step}: no reference gradient for {sorted(missing)}"
    refs = {n: ref[n].detach().double() for n in got}
    rms = math.sqrt(sum(float(r.square().sum()) for r in refs.values()) / sum(r.numel() for r in refs.values()))
    tau = grad_tolerance(step)
    out = {}
    for name, g in got.items():
        r = refs[name]
        assert g.shape == r.shape, (step, name, g.shape, r.shape)
        bound = tau * (float(r.norm()) + rms * math.sqrt(r.numel()))
        err = float((g.detach().double() - r).norm())
        out[name] = err / bound if bound > 0 else (math.inf if err else 0.0)  # all-zero reference: equal or not
    return out


def assert_gradients_close(got: list[dict], ref: list[dict], *, what: str = "") -> None:
    """Every step's gradients (a list of name -> tensor per step) within the error model above."""
    assert len(got) == len(ref) and got, (what, len(got), len(ref))
    worst = []  # per step: (err / bound, tensor name)
    for step, (g, r) in enumerate(zip(got, ref), 1):
        excess = gradient_excess(g, r, step)
        name = max(excess, key=excess.get)
        worst.append((excess[name], name))
    report = os.environ.get("PIPETRAIN_PARITY_REPORT")
    if report:  # every step, before any assertion stops the comparison
        with open(report, "a") as f:
            for step, (ratio, name) in enumerate(worst, 1):
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "what": what,
                                    "step": step, "worst": name, "err_over_bound": ratio,
                                    "capability": torch.backends.cpu.get_cpu_capability()}) + "\n")
    for step, (ratio, name) in enumerate(worst, 1):
        assert ratio <= 1, (f"{what} step {step}: gradient of {name} is {ratio:.2f}x the fp32 reassociation "
                            f"bound (tau_{step} = {grad_tolerance(step):.2e}, tests/_parity.py)")


def full_tensors(trainer, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Unsplit name -> the whole parameter (or its reduced gradient): FSDP2 shards, tp slices and ep
    blocks gathered (collective: every rank calls it). Weights without a gradient are left out."""
    from torch.distributed.tensor import DTensor

    from pipetrain.parallel.tp import gather_full

    out = {}
    tp, splits = trainer.parallel.tp, trainer.checkpointable.splits
    for s, name, p in trainer.pipe.named_parameters():
        stage = trainer.pipe.stages[s]
        t = p.grad if grads else p
        if t is None:  # the aux_free bias: moved by the pre-step hook, not by gradient
            continue
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        if tp is not None and name in stage.tp_shards:
            t = gather_full(t, stage.tp_shards[name], tp.g)
        if name in stage.ep_shards:  # expert parallel: every rank's block of experts (of their tp slices' whole)
            t = gather_full(t, stage.ep_shards[name], splits.ep)
        out[stage.tied.get(name, name)] = t
    return out
