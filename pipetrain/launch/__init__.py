"""Where the ranks run: cluster config, launchers (torch elastic, torchrun, SLURM via submitit)."""

from pipetrain.launch.errors import RankFailedError
from pipetrain.launch.launcher import launch

__all__ = ["RankFailedError", "launch"]
