"""End-to-end: the `pipetrain` command as a user types it (real subprocesses, real files)."""

import json
import re

import pytest

from conftest import run_cli

pytestmark = pytest.mark.e2e

ISSUE_CMD = ["mode=simulate", "model=sleep", "schedule=zbv", "pipeline.degree=8", "pipeline.microbatches=32"]


def test_simulate_writes_json_and_trace(tmp_path):
    run_dir = tmp_path / "run"
    res = run_cli([*ISSUE_CMD, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rec = json.loads((run_dir / "simulate.json").read_text())
    for key in ("schedule", "degree", "stages", "microbatches", "makespan", "busy_per_rank",
                "bubble_fraction_per_rank", "bubble_fraction_mean", "peak_activations_per_rank",
                "param_copies", "analytic_bubble"):
        assert key in rec, key
    assert rec["schedule"] == "zbv" and rec["degree"] == 8 and rec["stages"] == 16 and rec["microbatches"] == 32
    assert len(rec["busy_per_rank"]) == 8
    trace = json.loads((run_dir / "schedule_trace.json").read_text())
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(xs) == 8 * 2 * 32 * 3  # every F, B, W of 2 stages per rank
    # the timeline and the summary table were printed
    assert "rank 7" in res.stdout and "zbv" in res.stdout


def test_simulate_under_data_parallel_prints_ranks_and_reductions(tmp_path):
    # 16 sleep layers of 1M fp32 weights, 4 per stage of zbv at P=2: 16 MB per stage, 16 ms at 1 GB/s
    res = run_cli(["mode=simulate", "model=sleep", "schedule=zbv", "parallel.dp_replicate=2",
                   "model.params_per_layer=1000000", "cluster.dp_bandwidth_gbs=1", f"hydra.run.dir={tmp_path}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = re.findall(r"^\s*(\d)\s+(\d)\s+(\d)\s+(\d)\s+(\d\|\d)\s+(\d,\d)\s*$", res.stdout, re.M)
    assert rows == [("0", "0", "0", "0", "0|3", "0,1"), ("1", "0", "1", "0", "0|3", "0,1"),
                    ("2", "1", "0", "0", "1|2", "2,3"), ("3", "1", "1", "0", "1|2", "2,3")]
    assert "pp=2 x dp_replicate=2 = 4 ranks" in res.stdout and "dp │" in res.stdout
    rec = json.loads((tmp_path / "simulate.json").read_text())
    assert rec["data_parallel"]["reduce_ms"] == [16.0] * 4 and rec["data_parallel"]["overlap_reduce"] is True
    assert len(rec["reduce_exposed_ms_per_rank"]) == 2 and rec["makespan_with_reduce"] > rec["makespan"]
    trace = json.loads((tmp_path / "schedule_trace.json").read_text())
    assert sum(e.get("cat") == "reduce" for e in trace["traceEvents"]) == 4
    assert "REDUCE_GRAD" in (tmp_path / "schedule.csv").read_text()


def test_default_simulate_from_any_directory(tmp_path):
    res = run_cli(["mode=simulate", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "r" / "simulate.json").read_text())
    assert rec["schedule"] == "1f1b" and rec["degree"] == 2 and rec["partition"]["model"] == "gpt2-tiny"


def test_multirun_ends_with_one_comparison_table(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "mode=simulate", "model=sleep", "schedule=1f1b,zbh1,zbv,dualpipev",
                   "pipeline.microbatches=8,16,32", "sim.timeline=false", f"hydra.sweep.dir={sweep}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    records = json.loads((sweep / "sweep_summary.json").read_text())
    assert (sweep / "sweep_summary.csv").read_text().count("\n") == 13  # header + 12 rows
    assert len(records) == 12
    assert {(r["schedule"], r["microbatches"]) for r in records} == {
        (s, m) for s in ("1f1b", "zbh1", "zbv", "dualpipev") for m in (8, 16, 32)
    }
    tail = res.stdout[res.stdout.rindex("sweep of 12 runs") - 3000:]
    for s in ("1f1b", "zbh1", "zbv", "dualpipev"):
        assert s in tail


def test_recipe_then_cli_override(tmp_path):
    res = run_cli(["+recipe=sleep-p8", "schedule=dualpipe", "sim.timeline=false", f"hydra.run.dir={tmp_path}"],
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "simulate.json").read_text())
    assert rec["schedule"] == "dualpipe" and rec["degree"] == 8 and rec["param_copies"] == 2


def test_custom_schedule_file_round_trips(tmp_path):
    first = run_cli(["mode=simulate", "model=sleep", "schedule=zbh1", "pipeline.degree=4", "sim.timeline=false",
                     f"hydra.run.dir={tmp_path / 'a'}"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    csv = tmp_path / "my_schedule.csv"
    csv.write_text("# exported from zbh1\n" + (tmp_path / "a" / "schedule.csv").read_text())
    second = run_cli(["mode=simulate", "model=sleep", "schedule=custom", f"schedule.path={csv}", "pipeline.degree=4",
                      "sim.timeline=false", f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    a = json.loads((tmp_path / "a" / "simulate.json").read_text())
    b = json.loads((tmp_path / "b" / "simulate.json").read_text())
    assert a["makespan"] == b["makespan"] and a["peak_activations_per_rank"] == b["peak_activations_per_rank"]


def test_broken_custom_schedule_prints_the_grid(tmp_path):
    csv = tmp_path / "bad.csv"
    csv.write_text("0F0,0F1,0BW0\n1F0,1BW0,1F1,1BW1\n")  # rank 0 never runs 0BW1
    res = run_cli(["mode=simulate", "schedule=custom", f"schedule.path={csv}", "pipeline.microbatches=2"], cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert "0BW1" in res.stderr and "rank 0" in res.stderr and ">" in res.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["+recipe=missing"], "sleep-p8"),
        (["schedule=dualpipe", "pipeline.degree=3", "pipeline.microbatches=12"], "pipeline.degree"),
        (["pipeline.degre=3"], "degre"),
        (["schedule=nosuch"], "1f1b"),
        (["schedule=custom", "schedule.path=/nonexistent.csv"], "schedule.path"),
        (["model=nosuch"], "gpt2-medium"),
        (["partition=nosuch"], "balanced"),
    ],
)
def test_user_errors_are_one_clear_message(tmp_path, args, needle):
    res = run_cli(args, cwd=tmp_path)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert needle in res.stderr


def test_gpt2_balanced_on_four_stages(tmp_path):
    # the command of issue 3, as written
    res = run_cli(["mode=simulate", "model=gpt2", "partition=balanced", "pipeline.degree=4",
                   f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "simulate.json").read_text())
    assert rec["schedule"] == "1f1b" and rec["degree"] == 4 and "makespan" in rec  # existing keys unchanged
    part = rec["partition"]
    assert part["strategy"] == "balanced" and part["model"] == "gpt2" and part["num_layers"] == 14
    assert len(part["boundaries"]) == 3 and len(part["params"]) == len(part["est_ms"]) == 4
    assert part["imbalance"] == pytest.approx(max(part["est_ms"]) / (sum(part["est_ms"]) / 4) - 1, abs=1e-5)
    assert part["layers"][0].startswith("embed") and part["layers"][-1].endswith("head")
    # the partition table comes before the timeline
    out = res.stdout
    assert "partition=balanced" in out and "imbalance" in out
    assert out.index("imbalance") < out.index("rank 0")


@pytest.mark.parametrize(
    "args, needles",
    [
        (["model=gpt2", "model.n_head=5"], ["model.n_embd", "model.n_head"]),
        (["model=gpt2", "data.batch_size=12"], ["data.batch_size", "pipeline.microbatches"]),
        (["model=gpt2", "data.seq_len=2048"], ["data.seq_len", "model.block_size"]),
        (["model=gpt2-tiny", "schedule=zbv", "pipeline.degree=8", "pipeline.microbatches=16"], ["pipeline.degree"]),
        (["partition=manual"], ["partition.boundaries"]),
    ],
)
def test_model_and_partition_errors_are_one_line(tmp_path, args, needles):
    res = run_cli(args, cwd=tmp_path)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipetrain: error: "), res.stderr
    for needle in needles:
        assert needle in lines[0]
