"""The suite's error model for parity (tests/_parity.py) on hand-made gradients."""

from __future__ import annotations

import math

import pytest
import torch
from _parity import U, grad_tolerance, gradient_excess

pytestmark = pytest.mark.pure


def test_a_tensor_is_held_to_its_own_norm_plus_its_share_of_the_step():
    """A tensor that cancels to ~0 may carry errors of the step's scale; a large one only of its own."""
    ref = {"big": torch.ones(100), "tiny": torch.full((100,), 1e-9)}  # rms over both: ~0.71
    share = math.sqrt(sum(float(t.square().sum()) for t in ref.values()) / 200) * 10
    noise = {"big": ref["big"] + 1e-7, "tiny": ref["tiny"] + 1e-7}  # each off by 1e-6 in norm
    excess = gradient_excess(noise, ref, 1)
    assert excess["tiny"] == pytest.approx(1e-6 / (grad_tolerance(1) * (1e-8 + share)), rel=1e-3)
    assert excess["big"] < 1 and excess["tiny"] < 1
    assert gradient_excess({**ref, "big": ref["big"] * 1.001}, ref, 1)["big"] > 10  # 1e-3 of its own norm


def test_an_all_zero_reference_admits_only_zeros():
    zero = {"w": torch.zeros(4)}
    assert gradient_excess(zero, zero, 1) == {"w": 0.0}
    assert gradient_excess({"w": torch.full((4,), U)}, zero, 1) == {"w": math.inf}
