"""One rank's stages parallelized in torchtitan's order, from declared steps.

    cut (models/split.py, on the meta device)
      -> tensor parallel      parallel/tp_plan.py, from each layer's declared plan (parallel/layer_spec.py)
      -> expert parallel      parallel/ep.py: this rank's block of each declared stacked-experts module
      -> context parallel     parallel/cp.py: declared attention modules attend over the cp group's K/V
      -> activation recompute trainer.recompute / plan.recompute_stages: whole layers, or a layer's declared
                              modules (parallel/recompute.py)
      -> compile              trainer.compile: each layer, in place, after TP and before FSDP; where the
                              schedule runs the stage's B and W apart, its matrix-weight modules eager
      -> data parallel        FSDP2 under dp_shard (HSDP too; experts over their own mesh), plain
                              modules under dp_replicate
      -> materialize          only this rank's tp slices and dp shards (models/init.py: materialize)

A step is a function of (Parallelize, stage) that reads its own field and nothing of the others;
adding a parallelism is one field here, one step in `STEPS` and one degree in the layout
(parallel/layout.py), not a branch in the builder (train/pipeline.py): expert parallel came so.

`Parallelize.build` is the one place a rank's parallel setup is made from the config, the plan and
the groups; the trainer asks it, and names no single parallelism, for this rank's part of a batch
(`local_batch`: its pipeline's dp rows, under context parallel the positions it holds, and
`local_documents`: their documents, cut alike), the weights
split across ranks (`split_weights`: tp slices and ep experts, for checkpoints and materializing)
and the parallel layers' counts of a step (`take_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, Mapping, Optional, Protocol

from torch import nn

import torch

from pipetrain.compat import keep_compiled_backward
from pipetrain.parallel.cp import ContextAttention, context_parallel, local_positions, parallelize_context, positions
from pipetrain.parallel.dp import DataParallel, data_parallel, local_rows
from pipetrain.parallel.ep import expert_parallel, parallelize_experts
from pipetrain.parallel.layer_spec import ExpertsPlanned
from pipetrain.parallel.mesh import RankGroups
from pipetrain.parallel.recompute import recompute_modules
from pipetrain.parallel.split_weights import SplitWeights
from pipetrain.parallel.tp_plan import TensorParallel, tensor_parallel
from pipetrain.runtime.batch import Batch
from pipetrain.runtime.documents import Documents, documents
from pipetrain.runtime.ep_comm import EPGroup
from pipetrain.runtime.step_loss import GlobalTokens

if TYPE_CHECKING:
    from pipetrain.config import Config


class StagesPlan(Protocol):
    """What Parallelize.build reads of a plan (pipetrain.plan.Plan): which stages recompute, which compile."""

    recompute_stages: frozenset[int]
    compiled_stages: frozenset[int]


@dataclass(frozen=True)
class Parallelize:
    """What one rank applies to each of its stages. `recompute` and `compiled`: True for every
    stage, or a collection of stage ids (plan.recompute_stages, plan.compiled_stages)."""

    tp: Optional[TensorParallel] = None
    ep: Optional[EPGroup] = None
    cp: Optional[ContextAttention] = None
    recompute: bool | Collection[int] = False
    recompute_modules: tuple[str, ...] = ()  # trainer.recompute=selective: these modules, not whole layers
    compiled: bool | Collection[int] = False
    # compiled stages whose schedule runs B and W apart (train/pipeline.py: schedules/lower.py split_on)
    apart: Collection[int] = frozenset()
    dp: Optional[DataParallel] = None
    rows: tuple[int, int] = (0, 1)  # (this pipeline's index, pipelines): which rows of a global batch it trains

    @classmethod
    def build(cls, config: Config, plan: StagesPlan, groups: RankGroups) -> Parallelize:
        """This rank's parallel setup: each parallelism from its degree in the layout (None where it is
        1), recompute and compile from `plan`."""
        return cls(tp=tensor_parallel(config, groups), ep=expert_parallel(groups),
                   cp=context_parallel(groups, config.data.seq_len, config.parallel.cp_rotate),
                   recompute=plan.recompute_stages, compiled=plan.compiled_stages, dp=data_parallel(config, groups),
                   recompute_modules=tuple(t.recompute_modules) if (t := config.trainer).recompute == "selective"
                   else (),
                   rows=(groups.dp_index, config.layout.dp))

    def local_batch(self, batch: Batch) -> Batch:
        """This rank's part of a global batch: its pipeline's 1/dp of the rows, and under context
        parallel the positions this rank holds of them."""
        return local_positions(local_rows(batch, *self.rows), self.cp)

    def global_tokens(self, batch: Batch, microbatches: int) -> Optional[GlobalTokens]:
        """The global batch's loss tokens (targets != -1) and the ranks averaging gradients (dp x cp), where
        the loss units count unequal ones; a unit is what one loss averages over: a pipeline's microbatch
        (its dp slice cut in M, as local_batch and split_microbatches cut it) at one cp rank's positions.
        None where every unit counts the same: each microbatch's seed is then 1/M (runtime/step_loss.py)."""
        _, y = batch
        dp = self.rows[1]
        if y.is_floating_point() or y.dim() != 2 or y.shape[0] % (dp * microbatches):
            return None  # a model's own examples; a batch that does not cut is refused where it is cut
        counted = (y != -1).reshape(dp * microbatches, -1, y.shape[1])  # (dp M, rows, T): -1 is IGNORE_INDEX
        cp = 1 if self.cp is None else self.cp.g.size
        units = counted.sum((1, 2)) if cp == 1 else torch.stack(
            [counted[:, :, positions(y.shape[1], cp, r)].sum((1, 2)) for r in range(cp)])  # (dp M) or (cp, dp M)
        if bool((units == units.flatten()[0]).all()):
            return None
        return GlobalTokens(int(counted.sum()), dp * cp)

    def local_documents(self, batch: Batch, eos: Optional[int], microbatches: int) -> Optional[list[Documents]]:
        """Per microbatch of this rank's part of `batch` its documents (document masks, `eos` ends one), computed
        from its rows whole and cut as local_batch cuts them: under context parallel, where a rank's own
        positions cannot say which documents they belong to. None otherwise: the executor computes them
        from its microbatches (runtime/batch.py)."""
        if eos is None or self.cp is None:
            return None
        x, _ = local_rows(batch, *self.rows)
        whole, per = documents(x, eos), x.shape[0] // microbatches  # microbatches as train/data.py cuts them
        return [self.cp.local_documents(whole.rows(m * per, (m + 1) * per)) for m in range(microbatches)]

    def split_weights(self, stages: Mapping[int, nn.Module]) -> SplitWeights:
        """The weights of `stages` split across ranks (tp slices, ep experts; saved and materialized
        under their unsplit names); none without tensor or expert parallel."""
        return SplitWeights.of(self.tp.g if self.tp else None, stages, self.ep)

    def take_stats(self) -> dict[str, dict[str, float]]:
        """The parallel layers' counts since the last call, by parallelism ({"cp": ...} under context
        parallel; {} otherwise): a logged step's metrics (metrics/names.py cp/)."""
        return {"cp": self.cp.stats.take()} if self.cp is not None else {}

    def boundary_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A hidden (B, T, C) tensor crossing between stages as this rank holds it (cp, then sequence parallel)."""
        if self.cp is not None:
            shape = self.cp.boundary_shape(shape)
        return shape if self.tp is None else self.tp.boundary_shape(shape)

    def compiles(self, stage_id: int) -> bool:
        return self.compiled if isinstance(self.compiled, bool) else stage_id in self.compiled

    def apply(self, stage: nn.Module) -> nn.Module:
        for step in STEPS:
            stage = step(self, stage)
        return stage


def apply_tp(p: Parallelize, stage: nn.Module) -> nn.Module:
    return stage if p.tp is None else p.tp.wrap(stage)


def apply_ep(p: Parallelize, stage: nn.Module) -> nn.Module:
    return stage if p.ep is None else parallelize_experts(stage, p.ep)


def apply_cp(p: Parallelize, stage: nn.Module) -> nn.Module:
    return stage if p.cp is None else parallelize_context(stage, p.cp)


def apply_recompute(p: Parallelize, stage: nn.Module) -> nn.Module:
    on = p.recompute if isinstance(p.recompute, bool) else stage.stage_id in p.recompute
    stage.checkpoint_layers = on and not p.recompute_modules
    if on and p.recompute_modules:
        for layer in stage.layers.values():
            recompute_modules(layer, p.recompute_modules, compiled=p.compiles(stage.stage_id))
    return stage


def apply_compile(p: Parallelize, stage: nn.Module) -> nn.Module:
    """Each layer compiled in place (nn.Module.compile: parameter names stay the unsplit ones). A compiled
    graph's backward is one autograd node computing its input and weight gradients together, which W cannot
    re-enter (its gradients came out wrong, torch 2.13). Where the stage runs B and W apart, every module
    holding a matrix weight (Linear, tp's linears, the router, stacked experts, embeddings) runs eager
    between compiled graphs (Megatron's --delay-wgrad-compute keeps its weight-gradient GEMMs out of the
    fused backward alike): their weight-gradient GEMMs are W's (runtime/backward.py); the compiled graphs
    hold the norms, attention, activations and residuals, and a vector weight's gradient inside one (a
    norm's scale) is computed in B. docs/training.md has the measurement that chose this. Stacked experts
    (a layer's ep_plan) run eager under every schedule: their rows per expert change with every routing, and
    a compiled expert loop recompiled at each microbatch until dynamo's limit."""
    if not p.compiles(stage.stage_id):
        return stage
    apart = stage.stage_id in p.apart
    if apart:
        keep_compiled_backward()
    for layer in stage.layers.values():
        compile_layer(layer, apart=apart)
    return stage


def compile_layer(layer: nn.Module, *, apart: bool) -> None:
    """One layer compiled in place, its stacked experts eager, and with `apart` (B and W as separate actions)
    every module holding a matrix weight eager too (apply_compile)."""
    eager = [layer.get_submodule(path) for path in layer.ep_plan()] if isinstance(layer, ExpertsPlanned) else []
    if apart:
        eager += [m for m in layer.modules() if any(w.dim() >= 2 for w in m.parameters(recurse=False))]
    for module in {id(m): m for m in eager}.values():
        module.forward = torch.compiler.disable(module.forward)
    layer.compile()


def apply_dp(p: Parallelize, stage: nn.Module) -> nn.Module:
    return stage if p.dp is None else p.dp.wrap(stage)


STEPS: tuple[Callable[[Parallelize, nn.Module], nn.Module], ...] = (
    apply_tp, apply_ep, apply_cp, apply_recompute, apply_compile, apply_dp)
