"""Issue 6's acceptance, on real processes (gloo, wandb offline, real files; no mocks).

  - sleep model, P=4, M=16, 1F1B and ZB-V: the measured bubble is close to the one the
    simulator predicts from the measured per-stage op times (a busy-share ratio with a margin
    for loaded machines here; within 0.03 in bench/measured_bubble.py); trace.json is a Chrome
    trace with one row per rank;
  - GPT-2 tiny, P=2, M=8: rank 0's peak activation bytes under GPipe ~ M/P x 1F1B's, ZB-H1's ~ 1F1B's;
  - `logger=[console,jsonl,wandb]` with no credentials runs offline by itself, and the loss and
    bubble it logged read back from the run's .wandb file (wandb's protobuf records).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import spawn
from _logs import wandb_records
from pipetrain.models.sleep_module import _MAX_CREDIT_MS
from pipetrain.plan import make_plan

# 10 ms per layer and op (F, B, W), 2 layers per 1F1B stage, 1 per ZB-V stage: the executor's
# own overhead (~1 ms per action with 4 ranks on 2 cores) stays a few percent of every action.
SLEEP = ["mode=train", "model=sleep", "data=synthetic", "model.layers=8", "model.f_ms=10", "model.b_ms=10",
         "model.w_ms=10", "model.hidden=64", "pipeline.degree=4", "pipeline.microbatches=16", "data.batch_size=16",
         "trainer.max_steps=2", "trainer.eval_every=0", "trainer.ckpt_at_end=false", "trainer.device=cpu",
         "logger=[jsonl,trace]"]
# Measured busy share over simulated: 1 where the executor adds nothing. On a quiet machine the
# bubbles agree within 0.03 (~0.96 here; the tight bound is bench/measured_bubble.py); on 2 cores
# shared with other jobs wake-ups are late, and a ZB-V rank measured 1.18 once (bubble 0.23
# against 0.35 simulated from that step's late op times). A miscounted bubble (0 or 1, another
# rank's, a step's idle counted twice) is still far outside this band.
BUSY_RATIO = 0.75
GPT = ["mode=train", "model=gpt2-tiny", "data=synthetic", "pipeline.degree=2", "pipeline.microbatches=8",
       "data.batch_size=8", "data.seq_len=64", "trainer.max_steps=1", "trainer.eval_every=0",
       "trainer.ckpt_at_end=false", "trainer.device=cpu", "logger=[jsonl]"]


def fit_all(rank: int, world: int, out: Path, jobs: list) -> None:
    """Every rank trains each job in turn in one process group (one spawn for several runs)."""
    from pipetrain.train.trainer import rank_main

    for config, plan, run_dir in jobs:
        rank_main(config, plan, run_dir)


def train_all(compose, root: Path, base: list[str], schedules: tuple[str, ...]) -> dict[str, Path]:
    jobs = []
    for name in schedules:
        config = compose([*base, f"schedule={name}"])
        jobs.append((config, make_plan(config), root / name))
    spawn(fit_all, jobs[0][0].pipeline.degree, root / "spawn", jobs)
    return {name: root / name for name in schedules}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sleep_runs(compose, tmp_path_factory) -> dict[str, Path]:
    return train_all(compose, tmp_path_factory.mktemp("sleep"), SLEEP, ("1f1b", "zbv"))


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_measured_bubble_matches_the_simulated_one(sleep_runs, schedule):
    last = rows(sleep_runs[schedule])[-1]  # step 2: step 1 pays for warm-up
    assert last["step"] == 2
    measured, simulated = last["pipeline/bubble_measured"], last["pipeline/bubble_simulated"]
    # As a ratio of busy shares, (1 - measured) / (1 - simulated), with a margin that holds with
    # 4 ranks on 2 loaded cores; the tight bound (within 0.03, issue 6) is a benchmark on a
    # quiet machine: bench/measured_bubble.py.
    assert BUSY_RATIO <= (1 - measured) / (1 - simulated) <= 1 / BUSY_RATIO, (schedule, measured, simulated)
    for m, s in zip(*([last[f"pipeline/{k}/rank{r}"] for r in range(4)]
                      for k in ("bubble_measured", "bubble_simulated"))):
        assert BUSY_RATIO <= (1 - m) / (1 - s) <= 1 / BUSY_RATIO, last
    # the simulator was fed what the layers really took: ~20 ms F and ~40 ms BW per 1F1B stage
    # (2 layers: F sleeps twice, BW four times, SleepB and SleepW per layer), ~10 ms each of F, B
    # and W per ZB-V stage (1 layer, one sleep each). The floor is exact: each sleep ends at most
    # _MAX_CREDIT_MS early, paying back an earlier oversleep (sleep_module), so an op of k sleeps
    # ends at most k of those early (CI saw a 1F1B BW of 38.3 ms: 4 sleeps paying back 1.7 ms).
    # Late wake-ups on 2 loaded cores only lengthen an op, so the ceiling (1.5x + 2 ms) is loose,
    # yet it still refuses an op counted twice or fed another op's time.
    stages = 4 if schedule == "1f1b" else 8
    want = ((20, 2), (40, 4), (0, 0)) if schedule == "1f1b" else ((10, 1), (10, 1), (10, 1))
    for key, (ms, sleeps) in zip("fbw", want):
        got = [last[f"pipeline/stage{s}/{key}_ms"] for s in range(stages)]
        assert all(ms - sleeps * _MAX_CREDIT_MS - 0.5 <= x <= 1.5 * ms + 2 for x in got), (key, got)
    if schedule == "1f1b":  # (P-1) / (M+P-1) = 3/19, the paper's 1F1B bubble at equal F and B
        assert abs(simulated - 3 / 19) <= 0.02


@pytest.mark.dist
@pytest.mark.slow
def test_zero_bubble_v_measures_a_smaller_bubble_than_1f1b(sleep_runs):
    zbv, ofob = rows(sleep_runs["zbv"])[-1], rows(sleep_runs["1f1b"])[-1]
    assert zbv["pipeline/bubble_measured"] < ofob["pipeline/bubble_measured"] - 0.05


@pytest.mark.dist
@pytest.mark.slow
def test_trace_is_a_chrome_trace_with_one_row_per_rank(sleep_runs):
    trace = json.loads((sleep_runs["zbv"] / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names) == [0, 1, 2, 3] and names[0].startswith("rank 0")
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
    ops = [e for e in slices if e["cat"] in ("F", "B", "W")]
    assert len(ops) == 4 * 2 * 16 * 3  # every F, B, W of 2 stages per rank, 16 microbatches
    for r in range(4):  # each rank's row holds its own F, B and W, coloured by op, with microbatch ids
        mine = [e for e in ops if e["tid"] == r]
        assert {e["cat"] for e in mine} == {"F", "B", "W"} and len({e["cname"] for e in mine}) == 3
        assert sorted({mb for e in mine for mb in e["args"]["microbatches"]}) == list(range(16))
    sends = [e for e in events if e["ph"] == "s"]
    arrivals = [e for e in events if e["ph"] == "f"]
    assert sends and sorted(e["id"] for e in sends) == sorted(e["id"] for e in arrivals)
    assert len([e for e in slices if e["cat"] == "recv"]) == len(arrivals)
    assert trace["otherData"]["step"] == 2


@pytest.mark.dist
@pytest.mark.slow
def test_gpipe_holds_m_over_p_times_the_activations_of_1f1b(compose, tmp_path):
    runs = train_all(compose, tmp_path, GPT, ("gpipe", "1f1b", "zbh1"))
    act = {}
    for name, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        act[name] = summary["memory/activations_gb/rank0"]
        peak = summary["memory/peak_gb/rank0"]
        assert peak > act[name] > 0  # the rest: parameters, gradients and optimizer state
        row = rows(run_dir)[-1]
        for key in ("step", "train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s",
                    "pipeline/bubble_measured", "pipeline/bubble_measured/rank1", "pipeline/bubble_simulated",
                    "memory/peak_gb", "memory/peak_gb/rank1", "memory/activations_gb/rank0", "pipeline/stage1/f_ms"):
            assert key in row, key
    M, P = 8, 2
    assert abs(act["gpipe"] / act["1f1b"] - M / P) <= 0.15 * M / P, act
    assert abs(act["zbh1"] / act["1f1b"] - 1) <= 0.15, act


# ---- wandb ---------------------------------------------------------------------------------

def train_offline(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The MLP for a few steps with `logger=[console,jsonl,wandb]` and no credentials anywhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "no-netrc"))  # no credentials anywhere
    args = ["model=mlp", "data=synthetic", "trainer.log_every=1", "trainer.eval_every=0", "trainer.device=cpu",
            "logger=[console,jsonl,wandb]", "logging.wandb_project=pipetrain-test", *overrides,
            f"hydra.run.dir={tmp_path / 'run'}"]
    res = subprocess.run([sys.executable, "-m", "pipetrain.cli", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def offline_pair(tmp_path_factory) -> dict:
    """One wandb-logged run of 3 steps (a checkpoint at its end), then one that resumes it to 5;
    what the first left (its stdout, metrics.jsonl, wandb files) is kept before the second runs."""
    root = tmp_path_factory.mktemp("wandb")
    first = train_offline(root, "trainer.max_steps=3", "logging.wandb_tags=[ci,p2]")
    kept = {"root": root, "first": first, "rows": rows(root / "run"),
            "files": list((root / "run" / "wandb").glob("offline-run-*/run-*.wandb"))}
    train_offline(root, "trainer.max_steps=5", "trainer.resume=auto")
    return kept


@pytest.mark.e2e
@pytest.mark.slow
def test_wandb_offline_logs_loss_and_bubble_readable_from_the_run_file(offline_pair):
    res = offline_pair["first"]
    assert "logged offline" in res.stdout and "wandb sync" in res.stdout and "step 3/3" in res.stdout
    files = offline_pair["files"]
    assert len(files) == 1, files
    history, run = {}, None
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in record.history.item}
            history[items["_step"]] = items
        elif kind == "run":
            run = record.run
    assert run is not None and run.project == "pipetrain-test" and list(run.tags) == ["ci", "p2"]
    logged = {r["step"]: r for r in offline_pair["rows"]}
    assert sorted(logged) == [1, 2, 3]
    for step, row in logged.items():
        for key in ("train/loss", "pipeline/bubble_measured", "pipeline/bubble_measured/rank1", "memory/peak_gb/rank0",
                    "pipeline/stage1/f_ms", "perf/tokens_per_s"):  # the same names as metrics.jsonl
            assert history[step][key] == pytest.approx(row[key]), key
    tables = {k.split("/")[0]: h[k] for h in history.values() for k in h if k.endswith("/_type")}
    assert tables == {"timeline": "table-file", "per_rank": "table-file"}  # measured timeline, per-rank table


@pytest.mark.e2e
@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_marked_resumed(offline_pair):
    root = offline_pair["root"]  # the first run ended with a checkpoint (step 3); the second resumed it
    runs = {}  # offline-run directory -> (run id, resume flag, logged steps)
    for path in sorted((root / "run" / "wandb").glob("offline-run-*/run-*.wandb")):
        records = list(wandb_records(path))
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        steps = sorted(json.loads(it.value_json) for r in records if r.WhichOneof("record_type") == "history"
                       for it in r.history.item if (it.key or "/".join(it.nested_key)) == "_step")
        runs[path.parent.name] = (run.run_id, run.resume, steps)
    assert len(runs) == 2, runs
    (first_id, first_resume, first_steps), (second_id, second_resume, second_steps) = runs.values()
    assert first_id == second_id == (root / "run" / "wandb_id.txt").read_text().strip()
    assert not first_resume and second_resume  # wandb's own mark: resume requested for this id
    assert first_steps[:3] == [1, 2, 3] and second_steps[:2] == [4, 5]
