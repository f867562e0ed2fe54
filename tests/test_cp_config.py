"""Context parallel on the layout and in the config (pure): where the cp ranks sit, and the
one-line refusals before any rank starts."""

from __future__ import annotations

import pytest

from pipetrain.parallel.layout import Layout

pytestmark = pytest.mark.pure


def test_cp_sits_between_dp_shard_and_tp_and_shards_parameters():
    layout = Layout(pp=2, dp_shard=2, cp=2, tp=2)
    assert layout.shape == (2, 1, 2, 2, 2) and layout.world == 16 and layout.dp == 2
    assert layout.cp_ranks(0) == [0, 2] and layout.tp_ranks(0) == [0, 1]
    assert layout.dp_ranks(0) == [0, 2, 4, 6]  # dp_shard x cp hold the same parameters
    assert [Layout(cp=2).dp_mode, Layout(dp_replicate=2, cp=2).dp_mode] == ["shard", "hsdp"]
    assert Layout(pp=2, cp=2).describe() == "pp=2 x cp=2 = 4 ranks"


@pytest.mark.parametrize("overrides, message", [
    (["model=gpt2-tiny", "parallel.cp=2"], "model=gpt2-tiny is gpt2: set parallel.cp=1"),
    (["model=llama-tiny", "parallel.cp=2", "data.seq_len=30"], "set data.seq_len to a multiple of 4"),
    (["model=llama-tiny", "model.num_key_value_heads=4", "parallel.cp=2", "parallel.tp=4", "data.seq_len=12",
      "parallel.sequence_parallel=true"], "set data.seq_len to a multiple of 8"),
    (["model=llama-tiny", "parallel.cp=2", "parallel.cp_rotate=spiral"], "parallel.cp_rotate='spiral' is unknown"),
    (["model=llama-tiny", "parallel.cp=0"], "parallel.cp must be >= 1"),
])
def test_a_bad_cp_is_one_line_before_any_rank_starts(compose, overrides, message):
    with pytest.raises(Exception, match=message):
        compose(overrides)
