"""Where the ranks run: cluster config, launchers (torch elastic, torchrun, SLURM via submitit)."""

from pipetrain.launch.launcher import RankFailedError, launch

__all__ = ["RankFailedError", "launch"]
