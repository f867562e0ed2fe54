"""Launching: cluster config checks, the rank environment, real local (launch/agent.py) / torchrun / SLURM-env /
submitit-local runs on gloo, and the sbatch script for 2 nodes x 8 GPUs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, run_cli
from pipetrain.compose import compose as compose_dict, to_config
from pipetrain.config.cluster import ClusterConfig
from pipetrain.launch import RankFailedError, launch
from pipetrain.launch.resolvers import _shared_now
from pipetrain.launch.env import first_host, slurm_env, torchrun_env
from pipetrain.launch.sbatch import sbatch_for

TESTS = Path(__file__).resolve().parent
HAS_TRAINER = importlib.util.find_spec("pipetrain.train.trainer") is not None
needs_trainer = pytest.mark.skipif(not HAS_TRAINER, reason="pipetrain.train.trainer has not landed")
TINY = ["model=mlp", "trainer.max_steps=2", "sim.timeline=false"]  # the fastest real training run


def compose(overrides, hydra=False):
    cfg = compose_dict(overrides, return_hydra_config=hydra)
    return cfg if hydra else to_config(cfg)


def small_plan(overrides=()):
    from pipetrain.plan import make_plan

    config = compose(["model=sleep", "pipeline.degree=2", *overrides])
    return config, make_plan(config)


# Stand-ins for the trainer's rank_main(config, plan, run_dir) -> dict: a real collective on the
# default process group and a file per rank (module-level, so spawned workers import them by name).


def allreduce_entry(config, plan, run_dir: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # sum of 1..world on every rank
    record = {"rank": rank, "world": world, "sum": t.item(), "pid": os.getpid(),
              "backend": dist.get_backend(), "schedule": plan.schedule.name, "plan_ranks": plan.schedule.num_ranks,
              "run_dir": str(run_dir), "malloc": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
              "devices": [config.trainer.device, config.cluster.backend]}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    return record if rank == 0 else {}


def inherit_entry(config, plan, run_dir: Path) -> dict:
    """What a rank took from its launcher: environment, stdout, and who started it."""
    rank = dist.get_rank()
    print(f"rank {rank} prints to the launcher's stdout", flush=True)
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    record = {"parent": parent.decode(errors="replace"), "ppid": os.getppid(), "rank": os.environ.get("RANK"),
              "added": os.environ.get("PIPETRAIN_TEST_ADDED"), "removed": os.environ.get("WANDB_MODE")}
    (Path(run_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    return {}


def failing_entry(config, plan, run_dir: Path) -> dict:
    """Rank 1 raises; rank 0 waits in a collective rank 1 never joins and must be brought down."""
    (Path(run_dir) / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 is surely waiting in the collective by now
        raise ValueError("data.path=/nope does not exist: point data.path at a text file\nsecond line")
    t = torch.zeros(1)
    dist.all_reduce(t)
    return {}


# ---- pure: config, environment, Hydra wiring ---------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize("kwargs, knob", [
    (dict(name="k8s"), "cluster="),
    (dict(backend="mpi"), "cluster.backend"),
    (dict(nodes=2), "cluster.nodes"),  # local runs on one host
    (dict(name="torchrun", master_port=1234), "cluster.master_port"),  # torchrun brings MASTER_PORT
    (dict(name="submitit_local", partition="gpu"), "cluster.partition"),
    (dict(name="slurm", time_min=0), "cluster.time_min"),
    (dict(name="slurm", master_port=70000), "cluster.master_port"),
])
def test_cluster_config_errors_name_the_knob(kwargs, knob):
    with pytest.raises(ValueError) as err:
        ClusterConfig(**kwargs)
    assert knob in str(err.value) and "\n" not in str(err.value)


@pytest.mark.pure
def test_ranks_must_fill_the_nodes():
    assert ClusterConfig(name="slurm", nodes=2).tasks_per_node(16) == 8
    with pytest.raises(ValueError,
                       match="cluster.nodes=2 x cluster.ranks_per_node=4 = 8 tasks, but pipeline.degree=16"):
        ClusterConfig(name="slurm", nodes=2, ranks_per_node=4).check_world(16)
    with pytest.raises(ValueError, match="set cluster.nodes to a divisor of 3"):
        ClusterConfig(name="slurm", nodes=2).check_world(3)


@pytest.mark.pure
def test_first_host_of_slurm_node_lists():
    assert first_host("gpu[003-004,7],cpu1") == "gpu003"
    assert first_host("a-[1-2]-b[5,6]") == "a-1-b5"
    assert first_host("node7,node8") == "node7"
    assert first_host("n[10-11]") == "n10"


@pytest.mark.pure
def test_rank_env_from_slurm_and_torchrun_variables():
    env = slurm_env(env={"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (9, 16, 1, "gpu003")
    again = slurm_env(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "0",
                           "SLURM_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "4242"})
    assert again.master_port == env.master_port  # every task derives the same port from the job id
    with pytest.raises(ValueError, match="SLURM_PROCID.*not set: cluster=slurm"):
        slurm_env(env={})
    with pytest.raises(ValueError, match="RANK.*not set: cluster=torchrun runs under torchrun"):
        torchrun_env({})


@pytest.mark.pure
@pytest.mark.parametrize("cluster, var", [("torchrun", "RANK"), ("slurm", "SLURM_PROCID"),
                                          ("submitit_local", "SUBMITIT_LOCAL_GLOBALID")])
def test_only_rank0_writes_hydra_files_and_log(cluster, var, monkeypatch):
    """Every rank runs the Hydra job in the same directory; the others write no .hydra/ and log to /dev/null."""
    for rank, subdir in (("0", ".hydra"), ("1", None)):
        monkeypatch.setenv(var, rank)
        cfg = compose([f"cluster={cluster}", "hydra.runtime.output_dir=/run"], hydra=True)
        assert cfg.hydra.output_subdir == subdir
        log = cfg.hydra.job_logging.handlers.file.filename
        assert log == (f"/run/{cfg.hydra.job.name}.log" if rank == "0" else os.devnull)


@pytest.mark.pure
def test_submitit_local_knobs_reach_its_launcher():
    local = compose(["cluster=submitit_local", "pipeline.degree=3", "model=sleep", "cluster.gpus_per_node=1",
                     "cluster.time_min=30"], hydra=True).hydra.launcher
    assert local._target_.endswith("submitit_launcher.LocalLauncher")
    assert (local.tasks_per_node, local.gpus_per_node, local.timeout_min) == (3, 1, 30)
    slurm = compose(["cluster=slurm", "model=sleep"], hydra=True)  # submits its own script (tests/test_slurm.py)
    assert slurm.hydra.launcher._target_.endswith("BasicLauncher") and slurm.cluster.wait is False


@pytest.mark.pure
def test_sbatch_script_for_2_nodes_x_8_gpus():
    script = sbatch_for(["cluster=slurm", "pipeline.degree=16", "cluster.nodes=2", "cluster.gpus_per_node=8",
                         "cluster.partition=gpu", "cluster.time_min=90", "cluster.account=proj",
                         "cluster.setup=[module load cuda/12.4,source .venv/bin/activate]",
                         "model=sleep", "model.layers=32", "pipeline.microbatches=32", "data.batch_size=32"])
    lines = script.splitlines()
    for flag in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--time=90",
                 "--account=proj", "--job-name=pipetrain"):
        assert f"#SBATCH {flag}" in lines, (flag, script)
    setup = lines.index("module load cuda/12.4")
    assert lines[setup + 1] == "source .venv/bin/activate"
    srun = [n for n, line in enumerate(lines) if line.startswith("srun ")]
    assert len(srun) == 1 and srun[0] > setup and "pipetrain cluster=slurm pipeline.degree=16" in lines[srun[0]]


@pytest.mark.dist
def test_shared_now_is_the_first_ranks_clock(monkeypatch):
    """Ranks composing their config a second apart still get one run directory (a real TCPStore)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for k, v in dict(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                     TORCHELASTIC_RUN_ID="run-a").items():
        monkeypatch.setenv(k, v)
    first = _shared_now("%H-%M-%S.%f")
    time.sleep(0.05)
    assert _shared_now("%H-%M-%S.%f") == first
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-b")  # another launch: its own instant
    assert _shared_now("%H-%M-%S.%f") != first


@pytest.mark.pure
def test_world_size_must_equal_pipeline_degree(monkeypatch, tmp_path):
    config, plan = small_plan(["cluster=torchrun"])
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"1 ranks were started but pipeline.degree=2: start 2 ranks"):
        launch(config, plan, tmp_path)


# ---- real processes on gloo --------------------------------------------------------------


@pytest.mark.dist
def test_local_spawns_one_process_per_rank_and_returns_rank0(tmp_path):
    config, plan = small_plan()
    result = launch(config, plan, tmp_path, entry=allreduce_entry)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert result == records[0] and result["rank"] == 0
    assert all(r["world"] == 2 and r["sum"] == 3.0 and r["backend"] == "gloo" for r in records)
    # trainer.device=auto / cluster.backend=auto were decided by the launcher, once; the ranks got its answer
    assert all(r["devices"] == ["cpu", "gloo"] for r in records)
    pids = {r["pid"] for r in records}
    assert len(pids) == 2 and os.getpid() not in pids
    assert records[1]["malloc"] == "2000000000"  # CPU_MALLOC_ENV reached the gloo ranks
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ or os.environ.get("MALLOC_MMAP_THRESHOLD_") != "2000000000"


@pytest.mark.dist
def test_cpu_ranks_fork_from_a_warm_server_yet_start_as_spawned_ones(tmp_path, monkeypatch, capfd):
    """gloo ranks fork from a server that imported torch once (launch/forkserver.py), started
    before the launch; each still takes the launcher's environment and stdout of launch time."""
    from pipetrain.launch import prestart

    config, plan = small_plan()
    prestart(config)  # the server runs (its environment has WANDB_MODE: conftest set it at import)
    monkeypatch.setenv("PIPETRAIN_TEST_ADDED", "yes")
    monkeypatch.delenv("WANDB_MODE")
    capfd.readouterr()
    launch(config, plan, tmp_path, entry=inherit_entry)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in records] == ["0", "1"]  # what the launcher set per rank
    assert all(r["added"] == "yes" and r["removed"] is None for r in records), records
    assert all("forkserver" in r["parent"] and r["ppid"] != os.getpid() for r in records), records
    out = capfd.readouterr().out
    assert "rank 0 prints to the launcher's stdout" in out and "rank 1 prints to the launcher's stdout" in out


@pytest.mark.dist
def test_failing_rank_stops_the_others_with_its_own_one_line_message(tmp_path):
    config, plan = small_plan()
    start = time.time()
    with pytest.raises(RankFailedError) as err:
        launch(config, plan, tmp_path, entry=failing_entry)
    assert time.time() - start < 60  # rank 0, blocked in a collective, did not wait for a timeout
    message = str(err.value)
    assert message.startswith("rank 1 failed: ValueError: data.path=/nope does not exist") and "\n" not in message
    assert err.value.traceback_file == tmp_path / "error_rank1.txt"
    assert "second line" in err.value.traceback_file.read_text()  # the whole traceback is kept, not printed
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


@pytest.mark.dist
def test_slurm_path_with_srun_variables(tmp_path):
    """Two real processes with the variables srun gives its tasks rendezvous and agree on rank 0's run dir."""
    code = (
        "import sys, json; sys.path.insert(0, {tests!r})\n"
        "from test_launch import small_plan, allreduce_entry\n"
        "from pipetrain.launch import launch\n"
        "config, plan = small_plan(['cluster=slurm'])\n"
        "out = launch(config, plan, sys.argv[1], entry=allreduce_entry)\n"
        "print('RESULT', json.dumps(out))\n"
    ).format(tests=str(TESTS))
    procs = []
    for rank in range(2):
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(os.getpid()))
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"dir{rank}")], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    rank0 = json.loads(outs[0][0].split("RESULT ", 1)[1])
    assert rank0["world"] == 2 and rank0["sum"] == 3.0
    assert json.loads(outs[1][0].split("RESULT ", 1)[1]) == {}
    assert sorted(p.name for p in (tmp_path / "dir0").iterdir()) == ["rank0.json", "rank1.json"]
    assert not (tmp_path / "dir1").exists()  # rank 1 wrote into rank 0's directory


@pytest.mark.e2e
@pytest.mark.slow
@needs_trainer
def test_torchrun_ranks_share_one_run_dir(tmp_path):
    # %f: ranks that did not agree on one instant would land in two directories
    run_dir = str(tmp_path / "runs" / "${pipetrain.now:%H-%M-%S-%f}")
    env = dict(os.environ)
    env.pop("HYDRA_FULL_ERROR", None)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "pipetrain.cli",
         "cluster=torchrun", *TINY, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    run = runs[0]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["train/loss"] > 0
    assert "- cluster=torchrun" in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.e2e
@pytest.mark.slow
@needs_trainer
def test_submitit_local_sweep_of_two_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    res = run_cli(["-m", "cluster=submitit_local", "schedule=1f1b,zbv", *TINY, f"hydra.sweep.dir={sweep}"],
                  cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for job, schedule in ((0, "1f1b"), (1, "zbv")):
        run = sweep / str(job)
        assert f"schedule={schedule}" in (run / ".hydra" / "overrides.yaml").read_text()
        assert json.loads((run / "summary.json").read_text())["steps"] == 2
    # each job ran as 2 submitit tasks (one per pipeline rank), each with its own log
    task_logs = sorted(p.name.split("_", 1)[1] for p in (sweep / ".submitit").glob("*/*_log.out"))
    assert task_logs == ["0_log.out", "0_log.out", "1_log.out", "1_log.out"], task_logs


@pytest.mark.pure
@pytest.mark.parametrize("argv, expected", [
    ([], False), (["trainer.max_steps=1", "logger=[console,jsonl]"], False), (["mode=eval"], False),
    (["trainer.compile=true"], True), (["hydra.run.dir=/tmp/x", "schedule=zbv"], False),
    (["mode=simulate"], None), (["mode=plan"], None), (["mode=export"], None), (["+recipe=sleep-p8"], None),
    (["cluster=torchrun"], None), (["cluster.backend=nccl"], None), (["trainer.device=cuda"], None),
    (["--help"], None), (["-m", "schedule=1f1b,zbv"], None), (["--cfg", "job"], None), (["~logger"], None),
    (["hydra/launcher=submitit_local"], None),
])
def test_early_start_only_where_the_command_line_says_a_local_cpu_run(argv, expected):
    """The command starts the ranks' fork server at its first frame only where the command line alone
    says the run trains or evaluates on cluster=local without a GPU request (forkserver.early_start)."""
    from pipetrain.launch.forkserver import early_start

    assert early_start(argv) is expected
