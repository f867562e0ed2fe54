"""cluster=slurm without a cluster: the sbatch template rendered, `pipetrain [-m] cluster=slurm`
submitting to a stand-in `sbatch` and returning, and the script's `srun` line run by a
stand-in `srun` that starts the ranks on this host, which train."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from pipetrain.launch.sbatch import sbatch_for, template_text

TINY = ["model=mlp", "trainer.max_steps=2", "sim.timeline=false"]  # the fastest real training run

# sbatch as the cluster's: records its arguments, answers as SLURM does (refuses the job with
# $FAKE_SBATCH_REFUSES); with --wait it exits with $FAKE_JOB_EXIT, the submitted job's status
SBATCH = """#!{python}
import json, os, sys
with open(os.path.join(os.path.dirname(__file__), "sbatch.calls"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_SBATCH_REFUSES"):
    sys.exit("sbatch: error: Batch job submission failed: Invalid partition name specified")
print("Submitted batch job 4242", flush=True)
sys.exit(int(os.environ.get("FAKE_JOB_EXIT", "0")) if "--wait" in sys.argv else 0)
"""

# srun inside an allocation: SLURM_NTASKS copies of the command on this host, each with the
# variables srun gives its task; the first failure stops the others (--kill-on-bad-exit)
SRUN = """#!{python}
import os, subprocess, sys, time
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
env = os.environ
procs = [subprocess.Popen(args, env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NODEID="0",
                                         SLURM_STEP_ID="0", SLURM_NODELIST=env["SLURM_JOB_NODELIST"]))
         for r in range(int(env["SLURM_NTASKS"]))]
while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
    time.sleep(0.05)
for p in procs:
    if p.poll() is None:
        p.terminate()
codes = [p.wait() for p in procs]
with open(os.path.join(os.path.dirname(__file__), "srun.tasks"), "a") as f:
    f.write(f"{{len(procs)}}\\n")
sys.exit(next((c for c in codes if c), 0))
"""


@pytest.fixture
def slurm_bin(tmp_path):
    """A directory with the stand-in sbatch and srun, and an environment that puts it first on
    PATH (then this interpreter's, for `pipetrain`) and holds no SLURM job: a login node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sbatch", SBATCH), ("srun", SRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "HYDRA_FULL_ERROR"}
    env["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env.get("PATH", "")])
    return bin_dir, env


def sbatch_calls(bin_dir: Path) -> list[list[str]]:
    calls = bin_dir / "sbatch.calls"
    return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def run_in_allocation(script: Path, env: dict, cwd: Path, ntasks: int = 2):
    """Run an sbatch script as the batch step of a one-node job of `ntasks` tasks would."""
    import subprocess

    job = dict(env, SLURM_JOB_ID=str(os.getpid()), SLURM_NTASKS=str(ntasks), SLURM_NNODES="1",
               SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1")
    return subprocess.run(["bash", str(script)], cwd=cwd, env=job, capture_output=True, text=True, timeout=240)


# ---- the template ------------------------------------------------------------------------


@pytest.mark.pure
def test_template_fills_every_knob_and_switches_unset_ones_off():
    script = sbatch_for(["cluster=slurm", "pipeline.degree=4", "model=sleep", "cluster.nodes=2",
                         "cluster.gpus_per_node=2", "cluster.partition=gpu", "cluster.qos=high", "cluster.time_min=30",
                         "cluster.mem_gb=64", "cluster.setup=[module load cuda,source .venv/bin/activate]",
                         "schedule=zbv"])
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and not re.search(r"@[a-z_]+@", script)  # every placeholder filled
    for flag in ("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2", "--partition=gpu", "--qos=high",
                 "--time=30", "--mem=64G", "--job-name=pipetrain", "--output=slurm-%j.out", "--requeue",
                 "--signal=TERM@120"):
        assert f"#SBATCH {flag}" in lines, (flag, script)
    # knobs left null stay in the script, switched off for the user to fill in
    assert "##SBATCH --account=ACCOUNT" in lines and "##SBATCH --cpus-per-task=CPUS_PER_TASK" in lines
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1 and lines.index("module load cuda") < lines.index("source .venv/bin/activate") \
        < lines.index(srun[0])
    words = srun[0].split()
    at = words.index("pipetrain")
    assert words[at + 1] == "cluster=slurm"
    args = words[at + 2:]
    assert "schedule=zbv" in args and "cluster.nodes=2" in args and args[-1] == "run.name=slurm-${SLURM_JOB_ID}"
    assert not any(w.startswith(("cluster=", "'cluster.setup")) for w in args)  # the script's own lines
    named = sbatch_for(["cluster=slurm", "model=sleep", "run.name=mine"]).splitlines()[-1]
    assert named.endswith("run.name=mine") and "SLURM_JOB_ID" not in named


@pytest.mark.pure
def test_template_errors_are_one_line():
    with pytest.raises(ValueError, match="cluster.nodes=2 x cluster.ranks_per_node=4 = 8 tasks"):
        sbatch_for(["cluster=slurm", "pipeline.degree=16", "cluster.nodes=2", "cluster.ranks_per_node=4",
                    "model=sleep", "model.layers=32", "pipeline.microbatches=32", "data.batch_size=32"])
    with pytest.raises(ValueError, match="for cluster=slurm .got cluster=local.: add cluster=slurm"):
        sbatch_for(["cluster=local", "model=sleep"])


@pytest.mark.pure
def test_an_edited_template_renders_and_a_misspelled_placeholder_is_named(tmp_path):
    mine = tmp_path / "mine.sbatch"
    mine.write_text(template_text().replace("#SBATCH --time=@time_min@",
                                            "#SBATCH --time=@time_min@\n#SBATCH --exclusive"))
    assert "#SBATCH --exclusive" in sbatch_for(["cluster=slurm", "model=sleep"], template=mine).splitlines()
    mine.write_text(template_text().replace("@nodes@", "@node@"))
    with pytest.raises(ValueError, match="names @node@, which is not one of @name@, @nodes@") as err:
        sbatch_for(["cluster=slurm", "model=sleep"], template=mine)
    assert "\n" not in str(err.value)


@pytest.mark.pure
def test_launch_outside_a_job_and_outside_the_command_says_how_to_submit(monkeypatch, tmp_path):
    from pipetrain.compose import compose, to_config
    from pipetrain.launch import launch
    from pipetrain.plan import make_plan

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    config = to_config(compose(["cluster=slurm", "model=sleep"]))
    with pytest.raises(ValueError, match="submits from the pipetrain command") as err:
        launch(config, make_plan(config), tmp_path / "run")
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


# ---- submitting from a login node ---------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_sweep_submits_returns_and_its_script_trains(slurm_bin, tmp_path):
    """`pipetrain -m cluster=slurm` submits one job per sweep job, prints their ids and logs and
    returns; the script it submitted, run in an allocation, starts the ranks and trains."""
    bin_dir, env = slurm_bin
    sweep = tmp_path / "sweep"
    start = time.time()
    res = run_cli(["-m", "cluster=slurm", "schedule=1f1b,zbv", *TINY, f"hydra.sweep.dir={sweep}"],
                  cwd=tmp_path, env_extra=env, timeout=120)
    took = time.time() - start
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert took < 60, took  # no job ran: this machine only checked, simulated and submitted
    submitted = [line for line in res.stdout.splitlines() if line.startswith("submitted SLURM job 4242")]
    assert len(submitted) == 2 and all("log " in line and "run dir " in line for line in submitted), res.stdout
    calls = sbatch_calls(bin_dir)
    assert calls == [[str(sweep / str(n) / "pipetrain.sbatch")] for n in (0, 1)]  # no --wait
    script = (sweep / "1" / "pipetrain.sbatch").read_text()
    assert f"#SBATCH --output={sweep / '1'}/slurm-%j.out" in script.splitlines()
    srun = script.splitlines()[-1].split()
    assert "schedule=zbv" in srun and f"hydra.run.dir={sweep / '1'}" in srun and "logging.timeline=false" in srun
    assert not (bin_dir / "srun.tasks").exists()

    job = run_in_allocation(sweep / "1" / "pipetrain.sbatch", env, tmp_path)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert (bin_dir / "srun.tasks").read_text() == "2\n"
    assert "done: 2 steps" in job.stdout
    assert json.loads((sweep / "1" / "summary.json").read_text())["steps"] == 2
    assert "done: 2 steps" in (sweep / "1" / "pipetrain.log").read_text()


@pytest.mark.e2e
def test_wait_keeps_the_command_until_the_job_ends_and_failures_are_one_line(slurm_bin, tmp_path):
    bin_dir, env = slurm_bin
    run = tmp_path / "run"
    args = ["cluster=slurm", "cluster.wait=true", "model=sleep", "trainer.max_steps=1",
            "sim.timeline=false", f"hydra.run.dir={run}"]
    ok = run_cli(args, cwd=tmp_path, env_extra=env, timeout=120)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "waiting for job 4242 to end" in ok.stdout
    assert sbatch_calls(bin_dir) == [["--wait", str(run / "pipetrain.sbatch")]]
    failed = run_cli([*args[:-1], f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path,
                     env_extra=dict(env, FAKE_JOB_EXIT="3"), timeout=120)
    err = [line for line in failed.stderr.splitlines() if line.strip()]
    assert failed.returncode != 0 and len(err) == 1, failed.stderr
    assert (err[0].startswith("pipetrain: error: SLURM job 4242 ended with exit status 3: see ")
            and "slurm-4242.out" in err[0])
    refused = run_cli([*args[:-1], f"hydra.run.dir={tmp_path / 'run3'}"], cwd=tmp_path,
                      env_extra=dict(env, FAKE_SBATCH_REFUSES="1"), timeout=120)
    err = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(err) == 1 and "Invalid partition name specified" in err[0], refused.stderr


# ---- the template run by hand --------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_previewed_script_starts_the_ranks_through_srun_and_trains(slurm_bin, tmp_path):
    """`python -m pipetrain.launch.sbatch ... > run.sbatch`, then the script as sbatch runs it:
    srun starts 2 tasks, each `pipetrain cluster=slurm` reads its rank from srun's variables."""
    import subprocess

    bin_dir, env = slurm_bin
    preview = subprocess.run([sys.executable, "-m", "pipetrain.launch.sbatch", "cluster=slurm", *TINY],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert preview.returncode == 0, preview.stderr
    script = tmp_path / "run.sbatch"
    script.write_text(preview.stdout)
    job = run_in_allocation(script, env, tmp_path)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert (bin_dir / "srun.tasks").read_text() == "2\n" and not sbatch_calls(bin_dir)
    assert "done: 2 steps" in job.stdout
    runs = list((tmp_path / "outputs").iterdir())  # one directory for both ranks: run.name from the job id
    assert [r.name for r in runs] == [f"slurm-{os.getpid()}"], runs
    assert json.loads((runs[0] / "summary.json").read_text())["steps"] == 2
    assert "done: 2 steps" in (runs[0] / "pipetrain.log").read_text()
    # SLURM requeues the job (--requeue: a preemption, a node failure): the same script, the same job
    # id, SLURM_RESTART_COUNT=1. It resumes from the job's own checkpoint instead of starting over
    # and overwriting it (issue #44).
    saved = runs[0] / "checkpoints" / "step_000002"
    stamp = (saved / "meta.json").stat().st_mtime_ns
    requeued = run_in_allocation(script, dict(env, SLURM_RESTART_COUNT="1"), tmp_path)
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    assert ("requeued by SLURM (1x)" in requeued.stdout
            and f"resumed from {saved.resolve()} at step 2" in requeued.stdout)
    assert "nothing to do: resumed at step 2" in requeued.stdout
    assert (saved / "meta.json").stat().st_mtime_ns == stamp
