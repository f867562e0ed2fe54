"""The sbatch script that `pipetrain -m cluster=slurm ...` submits, rendered without submitting.

hydra-submitit-launcher hands the `hydra.launcher` node (conf/cluster/slurm.yaml maps our
cluster knobs onto it) to submitit's AutoExecutor, which renames the generic keys
(timeout_min -> time, tasks_per_node -> ntasks_per_node, mem_gb -> mem, ...) and renders
the script with `submitit.slurm.slurm._make_sbatch_string`. We do the same two steps, with
submitit's own tables and renderer, so what is printed is what would be submitted.

    python -m pipetrain.launch.sbatch cluster=slurm cluster.nodes=2 cluster.gpus_per_node=8 pipeline.degree=16
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

# hydra.launcher keys that configure the executor or the plugin, not the sbatch script
_NOT_SBATCH = ("_target_", "submitit_folder", "max_num_timeout")


def render_sbatch(launcher: Mapping[str, Any], *, folder: str | Path, num_jobs: int = 1) -> str:
    """The script for a resolved `hydra.launcher` node of the submitit_slurm launcher; `folder` is
    submitit's job folder, `num_jobs` > 1 renders the job array of a sweep."""
    from submitit.slurm import slurm

    rename = slurm.SlurmExecutor._equivalence_dict()
    params = {rename.get(k, k): v for k, v in launcher.items() if k not in _NOT_SBATCH and v is not None}
    if "mem" in params:
        params["mem"] = slurm._convert_mem(params["mem"])
    if num_jobs > 1:
        params["map_count"] = num_jobs
    folder = Path(folder).absolute()  # as submitit's executor stores it
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return slurm._make_sbatch_string(command=command, folder=folder, **params)


def sbatch_for(overrides: Sequence[str], *, sweep_dir: str = "multirun/SWEEP") -> str:
    """Compose pipetrain's config with these overrides (checked like a run) and render its script."""
    from omegaconf import OmegaConf

    from pipetrain.compose import compose, to_config

    cfg = compose([*overrides, f"hydra.sweep.dir={sweep_dir}"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    folder = launcher["submitit_folder"]
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra")
    config = to_config(cfg)
    if config.cluster.name != "slurm":
        raise ValueError(f"the sbatch script is for cluster=slurm (got cluster={config.cluster.name}): add cluster=slurm")
    return render_sbatch(launcher, folder=folder)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        print(sbatch_for(args if any(a.startswith("cluster=") for a in args) else ["cluster=slurm", *args]))
    except (ValueError, TypeError) as err:
        print(f"pipetrain: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
