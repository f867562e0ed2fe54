"""Tensor parallel's config and layout (pure: no process group): parallel.tp innermost on the
mesh, and every bad input one line before any process starts."""

from __future__ import annotations

import pytest

from pipetrain.launch.resolvers import _tasks_per_node
from pipetrain.parallel.layout import Layout
from test_layout import test_bad_layouts_are_one_line_before_any_process as one_line_error

pytestmark = pytest.mark.pure

LLAMA = ["model=llama-tiny", "mode=train"]  # 4 query heads, 2 kv heads, SwiGLU 384, vocabulary 512


def test_tp_is_the_innermost_dimension(compose):
    cfg = compose(["pipeline.degree=2", "parallel.dp_shard=2", "parallel.tp=2", "data.batch_size=16"])
    assert cfg.layout == Layout(2, 1, 2, 2) and cfg.layout.world == 8
    assert cfg.microbatch_size == 16 // (2 * 8)  # tp ranks share their pipeline's rows
    lay = cfg.layout
    assert lay.tp_ranks(5) == [4, 5] and lay.dp_ranks(5) == [5, 7] and lay.pipeline_ranks(5) == [1, 5]
    assert "tp=2" in lay.describe()


def test_gpt2_and_llama_accept_divisible_degrees(compose):
    assert compose(["parallel.tp=4", "mode=train"]).layout.tp == 4  # gpt2-tiny: 4 heads, vocabulary 512
    assert compose([*LLAMA, "parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=64"]).parallel.tp == 2


@pytest.mark.parametrize("overrides, words", [
    (["parallel.tp=3", "mode=train"], ["parallel.tp=3 must divide model.n_head=4"]),
    (["parallel.tp=2", "model.vocab_size=511", "mode=train"], ["parallel.tp=2 must divide model.vocab_size=511"]),
    ([*LLAMA, "parallel.tp=4"], ["parallel.tp=4 must divide model.num_key_value_heads=2"]),
    ([*LLAMA, "parallel.tp=2", "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=64"],
     ["must divide model.num_key_value_heads=1"]),
    ([*LLAMA, "parallel.tp=2", "model.intermediate_size=383"], ["must divide model.intermediate_size=383"]),
    ([*LLAMA, "parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=63"],
     ["data.seq_len=63", "multiple of 2"]),
    (["parallel.sequence_parallel=true", "mode=train"], ["set parallel.tp > 1"]),
    (["parallel.tp=0"], ["parallel.tp must be >= 1"]),
    (["model=mlp", "parallel.tp=2", "mode=train"], ["model=mlp has no tensor-parallel plan"]),
    (["cluster=slurm", "cluster.nodes=2", "cluster.ranks_per_node=2", "parallel.tp=2", "parallel.dp_shard=2"],
     ["cluster.nodes=2 x cluster.ranks_per_node=2", "the world of 8 ranks", "parallel.tp=2"]),
])
def test_bad_tp_input_is_one_line_before_any_process(compose, overrides, words):
    one_line_error(compose, overrides, words)


def test_dp_shard_fill_and_slurm_tasks_count_tp(compose, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = compose(["cluster=torchrun", "parallel.tp=2", "parallel.dp_shard=-1", "data.batch_size=16"])
    assert cfg.layout == Layout(2, 1, 2, 2)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(Exception, match="parallel.tp=2 = 4"):
        compose(["cluster=torchrun", "parallel.tp=2", "parallel.dp_shard=-1"])
    assert _tasks_per_node(2, 2, None, 1, 2, 2) == 4  # 8 ranks on 2 nodes


def test_the_launched_world_must_be_the_product(compose, tmp_path):
    """A torchrun world that is not pp x dp x tp fails in the rank before any group is built."""
    from pipetrain.launch.env import RankEnv
    from pipetrain.launch.rank import run_rank

    cfg = compose(["parallel.tp=2", "mode=train"])
    env = RankEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=1, use_env_store=False)
    with pytest.raises(ValueError, match="2 ranks were started but the world of 4 ranks") as info:
        run_rank(cfg, None, tmp_path, env, lambda *a: {}, agree=False)
    assert "parallel.tp=2" in str(info.value) and "\n" not in str(info.value)

