r"""The sbatch script of a run: `srun pipetrain cluster=slurm <overrides>` with its #SBATCH lines.

One template (templates/pipetrain.sbatch, shipped in the package) serves three uses: this
module's preview, a script to edit and submit by hand, and what `cluster=slurm` submits from a
login node (launch/submit.py writes it into the run directory and runs sbatch on it). So the
printed script is what would be submitted, and it runs as it stands: it starts the ranks with
srun and the `pipetrain` command, no pickled job behind it.

    python -m pipetrain.launch.sbatch cluster=slurm cluster.nodes=2 cluster.gpus_per_node=8 \
        pipeline.degree=16 > run.sbatch
    python -m pipetrain.launch.sbatch --template my.sbatch cluster=slurm ...   # your edited copy

Template: `@name@` placeholders; a line whose value is unset (a knob left null) is written as
`##SBATCH ...` (off: sbatch reads only `#SBATCH` lines), a line that is only `@setup@` becomes
the cluster.setup lines.
"""

from __future__ import annotations

import re
import shlex
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from pipetrain.config.parallel import world_text

if TYPE_CHECKING:
    from pipetrain.config import Config

TEMPLATE = "pipetrain.sbatch"
JOB_NAME = "pipetrain"
_PLACEHOLDER = re.compile(r"@([a-z_]+)@")
# run.name from the job id: every task composes the same run directory (an unnamed run would
# claim one per task), and a requeued job finds its checkpoints again (trainer.resume=auto)
_RUN_NAME = "run.name=slurm-${SLURM_JOB_ID}"


def template_text(path: Optional[str | Path] = None) -> str:
    """The shipped template, or the user's copy at `path`."""
    if path is not None:
        return Path(path).expanduser().read_text()
    return resources.files("pipetrain.launch").joinpath("templates").joinpath(TEMPLATE).read_text()


def job_args(overrides: Sequence[str]) -> list[str]:
    """The `pipetrain cluster=slurm ...` arguments of the script's srun line, shell-quoted (the
    template names cluster=slurm itself, and cluster.setup is the script's own lines)."""
    args = [shlex.quote(o) for o in overrides if o.partition("=")[0].lstrip("+~") not in ("cluster", "cluster.setup")]
    named = any(o.partition("=")[0] in ("run.name", "hydra.run.dir") for o in overrides)
    return args if named else [*args, _RUN_NAME]


def render(config: Config, args: Sequence[str], *, template: Optional[str] = None,
           output: str = "slurm-%j.out", name: str = JOB_NAME) -> str:
    """The script for a typed config with cluster=slurm: #SBATCH values from config.cluster
    (tasks per node from the world, checked), `args` (shell words) on the pipetrain line."""
    cluster = config.cluster
    if cluster.name != "slurm":
        raise ValueError(f"the sbatch script is for cluster=slurm (got cluster={cluster.name}): add cluster=slurm")
    layout = config.layout
    values: dict[str, Optional[object]] = {
        "name": name, "nodes": cluster.nodes,
        "tasks_per_node": cluster.tasks_per_node(layout.world, world_text(*layout.shape)),
        "gpus_per_node": cluster.gpus_per_node or None, "cpus_per_task": cluster.cpus_per_task,
        "mem": None if cluster.mem_gb is None else f"{cluster.mem_gb}G", "time_min": cluster.time_min,
        "partition": cluster.partition, "account": cluster.account, "qos": cluster.qos, "output": output,
        "args": " ".join(args),
    }
    lines = []
    for line in (template_text() if template is None else template).splitlines():
        if line.strip() == "@setup@":
            lines.extend(cluster.setup)
            continue
        names = _PLACEHOLDER.findall(line)
        unknown = [n for n in names if n not in values]
        if unknown:
            raise ValueError(f"the sbatch template names @{unknown[0]}@, which is not one of "
                             f"{', '.join('@' + k + '@' for k in [*values, 'setup'])}: correct the template")
        if any(values[n] is None for n in names):  # an unset knob: the line stays, switched off
            lines.append("#" + _PLACEHOLDER.sub(lambda m: m.group(1).upper(), line))
        else:
            lines.append(_PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), line))
    return "\n".join(lines) + "\n"


def sbatch_for(overrides: Sequence[str], *, template: Optional[str | Path] = None) -> str:
    """Compose pipetrain's config with these overrides (checked like a run) and render its script."""
    from pipetrain.compose import compose, to_config

    config = to_config(compose(list(overrides)))
    return render(config, job_args(overrides), template=None if template is None else template_text(template))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    template = None
    if "--template" in args:
        at = args.index("--template")
        if at + 1 >= len(args):
            print("pipetrain: error: --template takes a file: --template my.sbatch", file=sys.stderr)
            sys.exit(2)
        template = args[at + 1]
        del args[at:at + 2]
    try:
        print(sbatch_for(args if any(a.startswith("cluster=") for a in args) else ["cluster=slurm", *args],
                         template=template), end="")
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"pipetrain: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
