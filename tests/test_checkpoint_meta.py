"""What a resume says about the checkpoint's model and layout against this run's (train/checkpoint_meta.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.train.checkpoint_meta import FORMAT, check_compatible, fingerprint

pytestmark = pytest.mark.pure


def test_a_resume_refused_over_one_moe_field_names_that_field_only(compose):
    """One changed field of model.moe (a nested group of 20) is the one named, not two whole dumps (#44)."""
    saved, now = compose(["model=moe-tiny"]), compose(["model=moe-tiny", "model.moe.top_k=1"])
    meta = {"format": FORMAT, "fingerprint": fingerprint(saved)}
    with pytest.raises(ValueError) as err:
        check_compatible(meta, now, Path("step_000002"))
    message = str(err.value)
    assert "(model.moe.top_k: 2 -> 1)" in message and "num_experts" not in message, message
    assert "\n" not in message and len(message) < 300, message


def test_a_new_layout_is_a_note_naming_each_changed_knob(compose):
    saved, now = compose(["model=moe-tiny"]), compose(["model=moe-tiny", "pipeline.degree=4"])
    notes = check_compatible({"format": FORMAT, "fingerprint": fingerprint(saved)}, now, Path("step_000002"))
    assert notes == ["new layout (weights re-split by name): pipeline.degree: 2 -> 4"], notes
