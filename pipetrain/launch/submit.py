"""cluster=slurm on a login node: submit the run's sbatch script, say where it went, return.

The run was checked and simulated by the `pipetrain` command here, as any run is; its job runs
the same command under srun, one task per rank (`srun pipetrain cluster=slurm <overrides>
hydra.run.dir=<this run's directory>`), from the script launch/sbatch.py renders, kept as
<run dir>/pipetrain.sbatch so that it can be read or submitted again by hand. A sweep
(`pipetrain -m cluster=slurm ...`) submits one job per sweep job, each as its turn comes.

Why not hydra-submitit-launcher: it waits for every job's result by design (`j.results()` at
the end of its `launch`), so a SLURM sweep held the login shell, silently, until the last job
ended; a subclass that returns cannot be named as `hydra.launcher` (Hydra instantiates launchers
only from the `hydra_plugins` package); and the script it submits runs a pickle only submitit
writes, so it could not be shown for submitting by hand.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.launch.errors import RankFailedError
from pipetrain.launch.sbatch import JOB_NAME, job_args, render

if TYPE_CHECKING:
    from pipetrain.config import Config

SCRIPT = "pipetrain.sbatch"  # the submitted script, in the run directory
# what cli.sweep_job decides for a job of `pipetrain -m`, which the job's own rerun (not a sweep) would not
_SWEEP_DECIDED = ("logging.wandb_group", "sim.timeline", "logging.timeline")


class JobFailedError(RankFailedError):
    """The job waited for (cluster.wait=true) failed; which rank failed is in its log."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.rank, self.rank_message, self.traceback_file = 0, message, None


def submit(config: Config, run_dir: Path) -> dict:
    """sbatch this run's script (config.cluster.wait: sbatch --wait) and return {"submitted": job id}."""
    run_dir = Path(run_dir).resolve()
    args = job_args(rerun_args(config, run_dir))
    script = run_dir / SCRIPT
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "slurm-%j.out"
    script.write_text(render(config, args, output=str(log), name=JOB_NAME))
    wait = config.cluster.wait
    cmd = ["sbatch", *(["--wait"] if wait else []), str(script)]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise ValueError(f"cluster=slurm submits with sbatch, which is not on this machine's PATH: run it on a SLURM "
                         f"login node, or submit the script it wrote there: sbatch {script}") from None
    assert proc.stdout is not None
    first = proc.stdout.readline()  # "Submitted batch job 4242", also before --wait waits
    found = re.search(r"job (\d+)", first)
    if found is None:
        _, err = proc.communicate()
        why = (err.strip().splitlines() or [first.strip() or f"exit status {proc.returncode}"])[-1]
        raise ValueError(f"sbatch refused {script}: {why} (fix the cluster.* knob it names)")
    job = found.group(1)
    log = run_dir / f"slurm-{job}.out"
    print(f"submitted SLURM job {job}: run dir {_short(run_dir)}, "
          f"log {_short(log)} (and pipetrain.log there), script {_short(script)}", flush=True)
    if wait:
        print(f"waiting for job {job} to end (cluster.wait=true; Ctrl-C stops waiting, scancel {job} stops the job)",
              flush=True)
    else:
        print(f"follow: squeue -j {job}; tail -f {_short(log)}   stop: scancel {job}   "
              f"(cluster.wait=true keeps this command until the job ends)", flush=True)
    proc.communicate()  # without --wait, sbatch ends once it has said the id
    if proc.returncode:
        raise JobFailedError(f"SLURM job {job} ended with exit status {proc.returncode}: see {_short(log)}")
    return {"submitted": job, "run_dir": str(run_dir)}


def rerun_args(config: Config, run_dir: Path) -> list[str]:
    """The arguments that make `pipetrain cluster=slurm ARGS` in the job this run again: the
    command's own overrides (Hydra's record of this job), its config directories, this run
    directory, and what a sweep decided for its job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        raise ValueError("cluster=slurm submits from the pipetrain command (or srun it inside an allocation): "
                         "run `pipetrain cluster=slurm ...`")
    hydra = HydraConfig.get()
    args = [f"--config-dir={s.path}" for s in hydra.runtime.config_sources if s.provider == "command-line"]
    if hydra.job.config_name != "config":
        args.append(f"--config-name={hydra.job.config_name}")
    args += list(hydra.overrides.task)
    args.append(f"hydra.run.dir={run_dir}")
    if hydra.mode == RunMode.MULTIRUN:
        asked = {o.partition("=")[0].lstrip("+~") for o in hydra.overrides.task}
        args += [f"{knob}={_value(config, knob)}" for knob in _SWEEP_DECIDED if knob not in asked]
    return args


def _value(config: Config, knob: str) -> str:
    value: object = config
    for part in knob.split("."):
        value = getattr(value, part)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _short(path: Path) -> str:
    """A path relative to the working directory where it lies under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
