"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

Hydra composes YAML from `conf/` (and recipes) on top of these schemas, so a
misspelled key or a value of the wrong type fails during composition with a
message naming the key. Cross-field rules live in `__post_init__` and raise a
one-line `ValueError` naming the knob to change. Past the CLI layer only these
dataclasses travel; no DictConfig.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipetrain.schedules import registry


class Mode(str, enum.Enum):
    train = "train"
    simulate = "simulate"


@dataclass
class PipelineConfig:
    degree: int = 2  # P: pipeline ranks
    microbatches: int = 8  # M: microbatches per optimizer step, for every schedule

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ValueError(f"pipeline.degree must be >= 1 (got {self.degree})")
        if self.microbatches < 1:
            raise ValueError(f"pipeline.microbatches must be >= 1 (got {self.microbatches})")


@dataclass
class ScheduleConfig:
    name: str = "1f1b"
    virtual_stages: int = 1  # v: stages per rank (interleaved / looped BFS; V and mirror fix it at 2)
    path: Optional[str] = None  # schedule=custom: a .csv or .txt file
    placement: str = "loop"  # schedule=custom: loop | v | mirror

    def __post_init__(self) -> None:
        if self.name == registry.CUSTOM:
            if not self.path:
                raise ValueError("schedule=custom needs a file: add schedule.path=my_schedule.csv")
        else:
            registry.get(self.name)  # unknown names fail here with the list of choices
        if self.virtual_stages < 1:
            raise ValueError(f"schedule.virtual_stages must be >= 1 (got {self.virtual_stages})")


@dataclass
class ModelConfig:
    name: str = MISSING


@dataclass
class SleepModelConfig(ModelConfig):
    """Layers that take fixed times: the yardstick for schedule efficiency."""

    name: str = "sleep"
    layers: int = 16
    f_ms: float = 2.0  # forward time of one layer, one microbatch
    b_ms: float = 2.0  # input-gradient (B) time
    w_ms: float = 2.0  # weight-gradient (W) time
    hidden: int = 1024  # floats of activation each layer saves per sample

    def __post_init__(self) -> None:
        if self.layers < 1:
            raise ValueError(f"model.layers must be >= 1 (got {self.layers})")
        for knob in ("f_ms", "b_ms", "w_ms"):
            if getattr(self, knob) < 0:
                raise ValueError(f"model.{knob} must be >= 0 ms (got {getattr(self, knob)})")


@dataclass
class PartitionConfig:
    name: str = "uniform"

    def __post_init__(self) -> None:
        if self.name != "uniform":
            raise ValueError(f"partition={self.name!r} is unknown: choose partition=uniform")


@dataclass
class SimConfig:
    comm_ms: float = 0.0  # point-to-point latency added to every cross-rank dependency
    fb_overlap: float = 0.0  # an F&B pair costs (F + BW) * (1 - fb_overlap)
    timeline: bool = True  # print the per-rank timeline
    timeline_width: int = 0  # columns for the timeline; 0 = the terminal's width

    def __post_init__(self) -> None:
        if self.comm_ms < 0:
            raise ValueError(f"sim.comm_ms must be >= 0 (got {self.comm_ms})")
        if not 0.0 <= self.fb_overlap < 1.0:
            raise ValueError(f"sim.fb_overlap must be in [0, 1) (got {self.fb_overlap})")


@dataclass
class Config:
    mode: Mode = Mode.simulate
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    model: Any = MISSING  # one of the model schemas (SleepModelConfig, ...)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        if isinstance(self.model, ModelConfig) is False:
            raise TypeError("model= must name a model config (e.g. model=sleep)")
        s, p = self.schedule, self.pipeline
        if s.name != registry.CUSTOM:
            registry.check(s.name, p.degree, p.microbatches, s.virtual_stages)
        self._check_layers()

    def _check_layers(self) -> None:
        s = self.schedule
        chunks = registry.placement_for(
            s.name, self.pipeline.degree, s.virtual_stages, custom_placement=s.placement
        ).num_chunks
        layers = getattr(self.model, "layers", None)
        if layers is not None and chunks > layers:
            raise ValueError(
                f"schedule {s.name} with pipeline.degree={self.pipeline.degree} cuts the model into {chunks} "
                f"stages but model.layers={layers}: raise model.layers to >= {chunks} or lower pipeline.degree"
            )


MODEL_SCHEMAS: dict[str, type] = {"sleep": SleepModelConfig}


def register_configs() -> None:
    """Schemas in the ConfigStore: `config_schema` for the root, `<model>_schema` per model group option."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for name, schema in MODEL_SCHEMAS.items():
        cs.store(group="model", name=f"{name}_schema", node=schema)
