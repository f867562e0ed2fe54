"""Measured metrics, pure: timings laid out exactly as the simulator would run them must
measure as the simulator predicts; waiting is idle, not work; loggers' schema and output.
No torch, no processes."""

from __future__ import annotations

import json
import time

import pytest

from _logs import tensorboard_events
from pipetrain.config.logs import LoggingConfig, check_loggers
from pipetrain.loggers.console import metrics_line, rank_table
from pipetrain.loggers.trace import measured_trace
from pipetrain.metrics.measure import measure_step, stage_costs
from pipetrain.metrics.records import ActionTiming, CommEvent, RankSample
from pipetrain.schedules import registry
from pipetrain.schedules.ir import Overlap
from pipetrain.schedules.simulate import StageCosts, simulate

pytestmark = pytest.mark.pure


def samples_from_sim(sim, *, wait_ms: float = 0.0, skew_ms: float = 0.0) -> list[RankSample]:
    """What the executor would report if it ran exactly like the simulation. `wait_ms`: every
    action also sat that long in a receive before computing (its span grows, compute does not);
    `skew_ms`: rank r's step clock started r * skew_ms later than rank 0's."""
    out = []
    for r, row in enumerate(sim.timeline):
        timings, comm = [], []
        for i, ts in enumerate(row):
            start = ts.start - wait_ms - skew_ms * r
            parts = ts.step.parts()
            part_ms = tuple(sim.costs.action(a) for a in parts)
            timings.append(ActionTiming(i, str(ts.step), start, ts.end - skew_ms * r, wait_ms, part_ms))
            if wait_ms:
                comm.append(CommEvent("recv", "act", 0, 0, (r + 1) % sim.schedule.num_ranks, i,
                                      start, start + wait_ms))
        # every rank leaves the step's loss all-reduce at one moment, 1 ms after the last action
        # on the common axis: on rank r's own clock that is skew_ms * r earlier
        out.append(RankSample(rank=r, step_ms=sim.makespan, timings=timings, comm=comm,
                              peak_activation_sets=sim.peak_activations_per_rank[r],
                              peak_activation_bytes=1000 * (r + 1), param_bytes=10, grad_bytes=10,
                              optimizer_bytes=20, sync_ms=sim.makespan + 1.0 - skew_ms * r))
    return out


@pytest.mark.parametrize("name, P, M, v", [("1f1b", 4, 16, 1), ("zbv", 4, 16, 2), ("dualpipe", 4, 8, 2),
                                           ("interleaved_1f1b", 2, 8, 2)])
def test_a_run_that_matches_the_simulation_measures_as_simulated(name, P, M, v):
    sched = registry.build(name, P, M, v)
    n = sched.placement.num_stages
    costs = StageCosts(tuple(1.0 + 0.1 * s for s in range(n)), (1.5,) * n, (0.7,) * n)
    sim = simulate(sched, costs)
    m = measure_step(7, sched, samples_from_sim(sim))
    assert m.bubble_per_rank == pytest.approx(sim.bubble_fraction_per_rank, abs=1e-9)
    assert m.simulated.bubble_fraction_per_rank == pytest.approx(sim.bubble_fraction_per_rank, abs=1e-9)
    assert m.makespan_ms == pytest.approx(sim.makespan)
    # the medians fed to the simulator are the stage costs (F&B pairs split per part)
    for s in range(n):
        assert m.measured.costs.f[s] == pytest.approx(costs.f[s])
        if any(a.op.value == "B" and a.stage == s for a in sched.actions(sched.placement.rank_of(s))):
            assert (m.measured.costs.b[s], m.measured.costs.w[s]) == pytest.approx((1.5, 0.7))
        else:  # only full backwards: b carries BW, w = 0
            assert m.measured.costs.b[s] + m.measured.costs.w[s] == pytest.approx(2.2)


def test_a_bw_beside_b_and_w_apart_is_simulated_at_its_own_median():
    """dualpipev runs B and W apart and BW on every stage; under recompute a BW costs f + b + w, not
    b + w + 2f (measured, sleep model P=2 M=8: 715 ms a step; its costs re-simulated with BW as
    B + W gave 884 ms)."""
    sched = registry.build("dualpipev", 2, 8, 2)
    costs = StageCosts((1.0,) * 4, (2.0,) * 4, (2.0,) * 4, (3.0,) * 4)
    sim = simulate(sched, costs)
    m = measure_step(1, sched, samples_from_sim(sim))
    assert [m.measured.costs.fused(s) for s in range(4)] == pytest.approx([3.0] * 4)
    assert m.simulated.makespan == pytest.approx(sim.makespan)


def test_time_blocked_in_receives_is_idle_and_ranks_share_one_clock():
    sched = registry.build("1f1b", 4, 8)
    sim = simulate(sched, StageCosts.uniform(4, 2.0, 2.0, 2.0))
    # Each rank's own clock starts 1 ms later than the previous rank's, and every action first
    # waits 0.25 ms: on the common axis the step is the simulated one again.
    m = measure_step(1, sched, samples_from_sim(sim, wait_ms=0.25, skew_ms=1.0))
    assert m.offsets_ms == pytest.approx((0.0, 1.0, 2.0, 3.0))
    assert m.bubble_mean == pytest.approx(sim.bubble_fraction_mean, abs=1e-9)
    assert m.wait_ms(0) == pytest.approx(0.25 * len(sim.timeline[0]))
    # counting the waits as work would shrink the bubble: the measurement must not
    assert m.op_ms(0)["F"] == pytest.approx(2.0 * 8) and m.op_ms(0)["BW"] == pytest.approx(4.0 * 8)


def test_stage_costs_are_medians():
    sched = registry.build("1f1b", 2, 4)
    sim = simulate(sched, StageCosts.uniform(2, 1.0, 1.0, 0.0))
    samples = samples_from_sim(sim)
    slow = samples[0].timings[0]  # one F on stage 0 took 10x as long: the median ignores it
    samples[0].timings[0] = ActionTiming(slow.index, slow.step, slow.start_ms, slow.end_ms + 9.0, 0.0, (10.0,))
    assert stage_costs(sched, samples).f == (1.0, 1.0)


def test_record_and_tables_carry_what_the_loggers_promise():
    sched = registry.build("dualpipe", 2, 8, 2)
    sim = simulate(sched, StageCosts.uniform(4, 1.0, 1.0, 1.0))
    m = measure_step(3, sched, samples_from_sim(sim, wait_ms=0.1))
    rec = m.record()
    for key in ("pipeline/bubble_measured", "pipeline/bubble_measured/rank1", "pipeline/bubble_simulated",
                "pipeline/bubble_simulated/rank0", "memory/peak_gb", "pipeline/stage3/f_ms", "pipeline/stage0/w_ms"):
        assert key in rec, key
    assert [rec[f"memory/activations_gb/rank{r}"] for r in range(2)] == [1000e-9, 2000e-9]
    # activations + params + grads + optimizer; the run's peak is the most of any rank
    assert [rec[f"memory/peak_gb/rank{r}"] for r in range(2)] == [1040e-9, 2040e-9] and rec["memory/peak_gb"] == 2040e-9
    assert all(k.split("/")[0] in ("pipeline", "memory") for k in rec)
    assert any(isinstance(s, Overlap) for row in sched.steps for s in row)
    rows = m.timeline_rows()
    assert {r["op"] for r in rows} >= {"F", "F&B"} and len(rows) == sum(len(r) for r in sched.steps)
    json.dumps(rec), json.dumps(rows), json.dumps(m.rank_rows())  # JSON-ready
    trace = measured_trace(m)
    json.dumps(trace)
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert rank_table(m).row_count == 3  # two ranks and the mean


def test_gpu_reserved_peak_is_reported_beside_the_allocated_one_and_absent_on_cpu():
    """F9: on GPU the allocator's reserved peak (allocated + cached, fragmentation included) goes
    beside memory/peak_gb (allocated, unchanged) in the record, summary.json and the console line."""
    from pipetrain.metrics.step import RunSummary

    sched = registry.build("1f1b", 2, 4)
    sim = simulate(sched, StageCosts.uniform(2, 1.0, 1.0, 0.0))
    cpu = measure_step(1, sched, samples_from_sim(sim))
    assert not [k for k in cpu.record() if "reserved" in k]
    gpu_samples = samples_from_sim(sim)
    for r, s in enumerate(gpu_samples):
        s.cuda_peak_bytes, s.cuda_reserved_bytes = 3000 * (r + 1), 5000 * (r + 1)
    rec = measure_step(1, sched, gpu_samples).record()
    assert [rec[f"memory/peak_gb/rank{r}"] for r in range(2)] == [3000e-9, 6000e-9]
    assert [rec[f"memory/peak_reserved_gb/rank{r}"] for r in range(2)] == [5000e-9, 10000e-9]
    assert rec["memory/peak_reserved_gb"] == 10000e-9
    line = metrics_line({"step": 1, "train/loss": 1.0, "train/lr": 1e-3, "train/grad_norm": 1.0,
                         "perf/tokens_per_s": 1.0, "perf/step_time_s": 1.0, **rec}, 2, None)
    assert "mem 6.0KB (act 2.0KB, reserved 10.0KB)" in line, line
    summary = RunSummary(steps=1, first_loss=1.0, final_loss=1.0, final_val_loss=None, skipped_steps=0, tokens=8,
                         step_time_s=1.0, tokens_per_s=8.0, measured=True, peak_memory_bytes_per_rank=[3000, 6000],
                         peak_reserved_bytes_per_rank=[5000, 10000])
    out = summary.to_json()
    assert out["memory/peak_gb"] == 6000e-9 and out["memory/peak_reserved_gb/rank1"] == 10000e-9
    assert "memory/peak_reserved_gb" not in RunSummary(
        **{**summary.__dict__, "peak_reserved_bytes_per_rank": []}).to_json()


def test_rank_means_the_global_rank_in_every_view():
    """#44: under tp=2 x pp=2 pipeline 0 is global ranks 0 and 2. Its per-rank figures used to be
    named rank0 / rank1 (pipeline indexes) while the launcher's rank table meant global ranks, and
    memory/peak_gb saw one replica only. Now every name, table, timeline row, trace and summary
    entry says rank 0 and rank 2, the table's title says which pipeline it shows, and peak_gb is
    the most of every rank of the world."""
    from pipetrain.metrics import names
    from pipetrain.metrics.step import RunSummary

    sched = registry.build("1f1b", 2, 4)
    sim = simulate(sched, StageCosts.uniform(2, 1.0, 1.0, 0.0))
    m = measure_step(1, sched, samples_from_sim(sim), ranks=(0, 2), world_peak_memory_bytes=9000)
    rec = m.record()
    assert sorted(k for k in rec if k.startswith("pipeline/bubble_measured/")) == [
        "pipeline/bubble_measured/rank0", "pipeline/bubble_measured/rank2"]
    assert names.of_ranks(rec, names.ACTIVATIONS_GB) == [1000e-9, 2000e-9]  # pipeline order
    assert rec["memory/peak_gb"] == 9000e-9  # another replica's rank used the most
    assert [r["rank"] for r in m.rank_rows()] == [0, 2] and [r["pp"] for r in m.rank_rows()] == [0, 1]
    assert {r["rank"] for r in m.timeline_rows()} == {0, 2}
    threads = {e["args"]["name"] for e in measured_trace(m)["traceEvents"] if e.get("name") == "thread_name"}
    assert {t.split(" (")[0] for t in threads if t.startswith("rank")} == {"rank 0", "rank 2"}, threads
    table = rank_table(m)
    assert table.title == "step 1 per rank of pipeline 0 (ranks 0, 2; every pipeline runs it): measured vs simulated"
    assert [c._cells for c in table.columns][0][:2] == ["0", "2"]
    assert rank_table(measure_step(1, sched, samples_from_sim(sim))).title == "step 1 per rank: measured vs simulated"
    summary = RunSummary(steps=1, first_loss=1.0, final_loss=1.0, final_val_loss=None, skipped_steps=0, tokens=8,
                         step_time_s=1.0, tokens_per_s=8.0, measured=True, ranks=[0, 2],
                         bubble_fraction_per_rank=[0.1, 0.2], simulated_bubble_fraction_per_rank=[0.1, 0.2],
                         peak_memory_bytes_per_rank=[3000, 6000], peak_activation_bytes_per_rank=[1, 2],
                         world_peak_memory_bytes=7000)
    out = summary.to_json()
    assert out["pipeline/bubble_measured/rank2"] == 0.2 and "pipeline/bubble_measured/rank1" not in out
    assert out["memory/peak_gb"] == 7000e-9 and out["memory/peak_gb/rank2"] == 6000e-9


def test_metrics_line_starts_with_the_step():
    rec = {"step": 100, "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "perf/tokens_per_s": 12345.0,
           "perf/step_time_s": 0.05, "perf/mfu": 0.12, "pipeline/bubble_measured": 0.2,
           "pipeline/bubble_simulated": 0.19,
           "memory/peak_gb": 0.003, "memory/peak_gb/rank0": 0.002,
           "memory/peak_gb/rank1": 0.003, "memory/activations_gb/rank0": 0.001}
    line = metrics_line(rec, 200, 12.0)
    assert line.startswith("step 100/200 loss 2.5000")
    assert "bubble 20.0% (sim 19.0%)" in line and "mfu 12.0%" in line
    assert "mem 3.0MB (act 1.0MB)" in line  # the GB of memory/peak_gb, in decimal units like it
    assert "| 12.3k tok/s 50ms" in line
    slow = metrics_line({**rec, "perf/tokens_per_s": 41.66, "perf/step_time_s": 24.6}, 200, 12.0)
    assert "| 41.7 tok/s 24600ms" in slow, slow  # a slow step (cp at 2,048 tokens on CPU) is not "0.0k"


def test_logger_choices_fail_with_the_knob():
    check_loggers(["console", "jsonl", "trace", "wandb", "tensorboard"])
    with pytest.raises(ValueError, match=r"logger='mlflow' is unknown"):
        check_loggers(["console", "mlflow"])
    with pytest.raises(ValueError, match="logging.trace_step=9 is past trainer.max_steps=5"):
        LoggingConfig(trace_step=9).check(["jsonl"], max_steps=5)
    with pytest.raises(ValueError, match="logging.peak_tflops"):
        LoggingConfig(peak_tflops=0.0)


def test_logger_knobs_compose(compose):
    cfg = compose(["logger=[console,jsonl,wandb]", "logging.wandb_project=p", "logging.wandb_tags=[a,b]",
                   "logging.trace_step=3"])
    assert cfg.logger == ["console", "jsonl", "wandb"]
    assert cfg.logging.wandb_tags == ["a", "b"] and cfg.logging.chosen_step(cfg.trainer.max_steps) == 3
    assert compose([]).logger == ["console", "jsonl"]


@pytest.mark.parametrize("start_step, kept", [(0, [1, 2, 3, 4, 5, 6]), (4, [1, 2, 3, 4])])
def test_jsonl_drops_the_rows_a_resumed_run_redoes(compose, tmp_path, start_step, kept):
    """A run resumed at step 4 (a restart, or trainer.resume after a kill) redoes steps 5 and 6: their
    old rows go, as does a line torn by the kill, and every step ends with one row. A fresh start
    (step 0) in a directory that has rows appends after them, as before, but not onto a torn line."""
    from pipetrain.loggers.base import RunInfo
    from pipetrain.loggers.jsonl import JsonlLogger
    from pipetrain.metrics.step import StepRecord

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 10.0 - s}) + "\n" for s in range(1, 7))
                    + '{"step": 7, "train/lo')  # killed mid-write
    logger = JsonlLogger()
    logger.start(RunInfo(compose([]), tmp_path, 8, start_step, 8))
    for step in range(start_step + 1, 9):
        logger.log(StepRecord(step=step, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1, tokens_per_s=1.0))
    logger.finish(None, None, None)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == kept + list(range(start_step + 1, 9))
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]  # no temporary file left


def test_a_full_disk_never_tears_a_metrics_row(compose, tmp_path):
    """#44: a full disk (an async save's files filled it) left metrics.jsonl ending in a torn row.
    On a 64 KiB tmpfs filled up but for the rest of the file's last page, rows are logged until one
    does not fit (a short write): it is refused in one line naming the file, and every row in the
    file is whole."""
    import subprocess

    from pipetrain.files import DiskFull
    from pipetrain.loggers.base import RunInfo
    from pipetrain.loggers.jsonl import JsonlLogger
    from pipetrain.metrics.step import StepRecord

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.strip()}")
    logger = JsonlLogger()
    try:
        logger.start(RunInfo(compose([]), disk, 10_000, 0, 10_000))
        row = lambda step: StepRecord(step=step, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=0.1,  # noqa: E731
                                      tokens_per_s=1.0)
        logger.log(row(1))  # the file's first page is allocated: the next rows fill it, then one crosses its end
        with (disk / "filler").open("wb", buffering=0) as f:  # the rest of the disk, as a checkpoint's files would
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        with pytest.raises(DiskFull) as info:
            for step in range(2, 10_000):
                logger.log(row(step))
        text = (disk / "metrics.jsonl").read_text()
    finally:
        logger.finish(None, None, None)
        subprocess.run(["umount", str(disk)], check=True)
    rows = [json.loads(line) for line in text.splitlines()]  # every line whole
    assert text.endswith("\n") and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert str(info.value) == (f"{disk / 'metrics.jsonl'}: no space left on device: step {len(rows) + 1}'s row was "
                               f"not written (the rows before it are whole): free space in {disk}")


def _tensorboard_points(tb_dir) -> dict[tuple[int, str], list[float]]:
    """(step, tag) -> values, read as TensorBoard reads a directory: event files in name order, and
    a session START at step S (a SummaryWriter's purge_step) drops what came before at steps >= S."""
    from tensorboardX.proto.event_pb2 import SessionLog

    seen: list[tuple[int, str, float]] = []
    for event in tensorboard_events(tb_dir):
        if event.HasField("session_log") and event.session_log.status == SessionLog.START:
            seen = [p for p in seen if p[0] < event.step]
        seen += [(event.step, v.tag, v.simple_value) for v in event.summary.value
                 if v.WhichOneof("value") == "simple_value"]
    points: dict[tuple[int, str], list[float]] = {}
    for step, tag, value in seen:
        points.setdefault((step, tag), []).append(value)
    return points


def test_tensorboard_hides_the_points_a_resumed_run_redoes(compose, tmp_path):
    """Steps 1-6 logged, the run resumed at step 4 logs 5-8: TensorBoard shows one point per step,
    the redone one for 5 and 6."""
    from pipetrain.loggers.base import RunInfo
    from pipetrain.loggers.tensorboard import TB_DIR, TensorBoardLogger
    from pipetrain.metrics.step import RunSummary, StepRecord

    for start, steps, loss in ((0, range(1, 7), 9.0), (4, range(5, 9), 1.0)):
        # event files are named by second and pid: a resumed run is another process, seconds later;
        # here both legs share the pid, so the second one starts in the next second
        time.sleep(1.01 - time.time() % 1 if start else 0)
        logger = TensorBoardLogger()
        logger.start(RunInfo(compose([]), tmp_path, 8, start, 8))
        for step in steps:
            logger.log(StepRecord(step=step, loss=loss, lr=1e-3, grad_norm=1.0, step_time_s=0.1, tokens_per_s=1.0))
        logger.finish(RunSummary(steps=steps[-1], first_loss=9.0, final_loss=loss, final_val_loss=None, skipped_steps=0,
                                 tokens=0, step_time_s=0.1, tokens_per_s=1.0), None, None)
    losses = {step: v for (step, tag), v in _tensorboard_points(tmp_path / TB_DIR).items() if tag == "train/loss"}
    assert losses == {1: [9.0], 2: [9.0], 3: [9.0], 4: [9.0], 5: [1.0], 6: [1.0], 7: [1.0], 8: [1.0]}


def test_the_summarys_per_rank_bubbles_are_medians_over_the_measured_steps(compose, tmp_path):
    """summary.json's per-rank bubbles were the last measured step's (issue #44): one slow last step
    (another job on the machine, a checkpoint's pause) stood for the run. Now each rank's median over
    the measured steps after the first, as the run's mean bubble already was."""
    import torch

    from pipetrain.metrics.step import RunSummary, StepRecord
    from pipetrain.plan import make_plan
    from pipetrain.train.monitor import Monitor

    config = compose(["logger=[]"])  # no logger: the summary is what is checked
    plan = make_plan(config)
    monitor = Monitor(config, plan, device=torch.device("cpu"), run_dir=tmp_path)
    sched = registry.build("1f1b", 2, 4, 1)
    even = samples_from_sim(simulate(sched, StageCosts((1.0, 1.0), (2.0, 2.0), (0.0, 0.0))))
    slow = samples_from_sim(simulate(sched, StageCosts((1.0, 1.5), (2.0, 3.0), (0.0, 0.0))))  # stage 1 slower
    for step, samples in ((1, slow), (2, even), (3, even), (4, slow)):
        monitor.log(StepRecord(step=step, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=1.0, tokens_per_s=1.0,
                               measurement=measure_step(step, sched, samples)))
    last, steady = (measure_step(1, sched, s).bubble_per_rank for s in (slow, even))
    assert last != pytest.approx(steady, abs=1e-3)  # the last step stands apart
    summary = monitor.summarize(RunSummary(steps=4, first_loss=1.0, final_loss=1.0, final_val_loss=None,
                                           skipped_steps=0, tokens=8, step_time_s=1.0, tokens_per_s=8.0))
    assert summary.bubble_fraction_per_rank == pytest.approx(steady, abs=1e-6)
