"""Where the ranks run: launchers (torch elastic, torchrun, SLURM via submitit); their schema is
pipetrain/config/cluster.py, the resolvers of the cluster configs resolvers.py."""

from pipetrain.launch.errors import RankFailedError, RunStopped
from pipetrain.launch.launcher import launch, prestart, prestart_early

__all__ = ["RankFailedError", "RunStopped", "launch", "prestart", "prestart_early"]
