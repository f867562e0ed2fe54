"""How a config's ranks execute beside their schedule: the device they compute on, where partition=profile
measures (and so where the layer costs come from), which stages compile or recompute, and whether F&B pairs
hide expert-parallel all-to-alls (runtime/overlap.py applies the same rule). Pure but for the device probe;
plan.py makes the plan from these.
"""

from __future__ import annotations

from pipetrain.config import Config, SleepModelConfig
from pipetrain.config.cluster import one_hw_queue


def profile_device(config: Config) -> str:
    """Where partition=profile measures: where the ranks compute (trainer.device), on CUDA the current
    device ("cuda:0" in the launcher and in rank 0 before set_device; never every rank's GPU 0)."""
    import torch

    if run_device(config) == "cpu":
        return "cpu"
    return f"cuda:{torch.cuda.current_device()}"


def run_device(config: Config) -> str:
    """Where this run's ranks compute: trainer.device, its auto resolved as the ranks resolve it."""
    if config.trainer.device != "auto":
        return config.trainer.device
    from pipetrain.launch.devices import visible_gpus  # no torch where no GPU driver is

    return "cuda" if visible_gpus() > 0 else "cpu"


def measures_here(config: Config) -> bool:
    """Whether this process times the layers of partition=profile: yes, unless it is a rank other than
    0 of a launch whose every rank plans (torchrun, slurm, submitit): 8 processes of a node building
    layers on one GPU at once would contend (and once ran out of memory); rank 0's plan is the one
    the ranks run (launch/rank.py broadcasts it)."""
    from pipetrain.launch.resolvers import process_rank

    return process_rank(config.cluster.name) == 0


def cost_source(config: Config) -> str:
    if config.partition.name == "profile" and measures_here(config):
        return f"measured:{profile_device(config)}"
    return "sleep" if isinstance(config.model, SleepModelConfig) else "analytic"


def overlap_on(config: Config) -> bool:
    """Whether the run's F&B pairs hide one microbatch's all-to-alls under the other's compute (`overlaps`)."""
    mode = config.pipeline.fb_overlap
    # only auto asks where the ranks compute (which may import torch: a sleep model's plan does not)
    return overlaps(mode, recompute=config.trainer.activation_checkpointing,
                    one_queue=mode == "auto" and one_hw_queue(run_device(config)))


def pairs_fb(config: Config) -> bool:
    """Whether the run's forwards pair with the next backward of another microbatch (schedules/lower.py
    pair_fb): where F&B pairs hide expert-parallel all-to-alls (`overlap_on` with parallel.ep > 1)."""
    return config.parallel.ep > 1 and overlap_on(config)


def overlaps(mode: str, *, recompute: bool, one_queue: bool = False) -> bool:
    """pipeline.fb_overlap as runtime/overlap.py applies it: on, or auto (stages run node by node) unless the GPUs'
    streams share one hardware queue (config/cluster.py one_hw_queue); never under activation recompute. Only
    stages whose layers have all-to-alls (parallel.ep > 1) are then priced per layer (overlap_layers); `on` is
    priced as asked even where the run refuses it (a what-if)."""
    if mode == "off" or recompute:
        return False
    return mode == "on" or not one_queue


def compiled_stages(config: Config, num_stages: int) -> frozenset[int]:
    """The stage ids whose layers are compiled: every stage under trainer.compile, else none."""
    return frozenset(range(num_stages)) if config.trainer.compile else frozenset()


def recompute_stages(config: Config, num_stages: int) -> frozenset[int]:
    """The stage ids that recompute (trainer.recompute full or selective): none with recompute=none, else
    trainer.recompute_stages (every stage when null), each checked against the schedule's stages."""
    t = config.trainer
    if t.recompute == "none":
        return frozenset()
    if t.recompute_stages is None:
        return frozenset(range(num_stages))
    bad = [s for s in t.recompute_stages if s >= num_stages]
    if bad:
        raise ValueError(f"trainer.recompute_stages={list(t.recompute_stages)}: stage {bad[0]} does not exist, the "
                         f"schedule has stages 0..{num_stages - 1}: list stage ids below {num_stages}")
    return frozenset(t.recompute_stages)
