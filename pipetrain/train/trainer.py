"""The training loop of one pipeline rank: build, step, evaluate, checkpoint, report.

`rank_main` runs in every rank process after the process group is up (the launcher's
job). The plan (validated schedule + partition) was computed once, before any process
started, so every rank cuts the model the same way. Each step: the batch of step k (a
function of (seed, k)), split into M microbatches; the executor runs this rank's
actions; copies' gradients are summed; the global gradient norm (each weight counted
once) is clipped; AdamW steps with the warm-up + cosine learning rate. At logged steps the
executor's timings and memory of every rank go to rank 0 (train/monitor.py), which hands
measured and simulated bubble, memory, loss and throughput to the loggers `logger=[...]` names,
as one typed `StepRecord` per logged step; the run ends with a `RunSummary`, which the trainer
writes to summary.json whatever the loggers (metrics/step.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from pipetrain.config import Config
from pipetrain.metrics.names import mtp_metrics
from pipetrain.metrics.step import RunSummary, StepRecord
from pipetrain.parallel.mesh import build_groups
from pipetrain.parallel.timeouts import bound_waits
from pipetrain.parallel.parallelize import Parallelize
from pipetrain.plan import Plan
from pipetrain.train.pipeline import rank_pipeline
from pipetrain.train import checkpoint
from pipetrain.train.checkpoint import Checkpointable, TrainState
from pipetrain.train.checkpoint_dirs import Note, silent
from pipetrain.train.checkpoint_async import AsyncSaver
from pipetrain.train.data import build_data
from pipetrain.train.step_input import StepInput
from pipetrain.train.monitor import Monitor
from pipetrain.launch.env import slurm_requeues
from pipetrain.train.restart import Restart, StepTracker, restart_count, this_restart
from pipetrain.train.stop import RANKS, StopSignals, hold_presence, signal_name, write_stopped
from pipetrain.launch.errors import STOPPED
from pipetrain.train.device import set_up_device
from pipetrain.train.moe_hooks import attach_moe_hooks, moe_stats
from pipetrain.train.profiling import StepProfiler
from pipetrain.train.optim import clip_grads, global_grad_norm, lr_at, make_optimizer, set_lr


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (trainer.on_nonfinite=stop)."""


class Trainer:
    """One rank's share of the training job."""

    def __init__(self, config: Config, plan: Plan, run_dir: Path, *, train_data: bool = True) -> None:
        """`train_data=False` (mode=eval): no training data source is built; eval reads its own file."""
        self.config, self.plan, self.run_dir = config, plan, Path(run_dir)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = set_up_device(config.trainer)  # with its threads and matmul precision
        self.groups = build_groups(config.layout, self.device.type)  # the one DeviceMesh (under dp)
        self.parallel = Parallelize.build(config, plan, self.groups)  # this rank's parallel setup
        # the model's shapes (meta) for the data; pretrained_files: the model.pretrained files this rank read
        self.pipe, model, self.pretrained_files = rank_pipeline(config, plan, self.groups, self.parallel, self.device)
        self.data = build_data(config.data, seed=config.trainer.seed,
                               vocab_size=config.model.vocab_size or 0, model=model) if train_data else None
        self.optimizer = make_optimizer(self.pipe.parameters(), config.optim, device=self.device)
        if config.model.moe_config is not None:
            attach_moe_hooks(self.pipe.stages.values(), self.optimizer, microbatches=config.pipeline.microbatches,
                             batch_group=self.groups.batch_group,
                             sequence_group=self.groups.tp_group if config.parallel.sequence_parallel else None)
        self.state = TrainState(decay_steps=config.optim.decay_steps or config.trainer.max_steps)
        splits = self.parallel.split_weights(self.pipe.stages)  # tp slices, ep experts: saved as shards
        self._stepped = False  # whether this process ran a training step (a compiled run's first waits longer)
        self.skipped_in_a_row = 0  # trainer.on_nonfinite=skip: non-finite steps since the last good one
        self.stop = StopSignals()  # SIGTERM / SIGINT: finish the step, save it, stop (train/stop.py)
        self.stopped: Optional[dict[str, Any]] = None  # where to resume (rank 0's record), after a signal
        self.tracker = StepTracker(self.rank)  # the step in progress, for a restart's message
        self.checkpointable = Checkpointable(self.pipe.sync, self.optimizer, self.state, splits)
        self.tokens_per_step = config.data.batch_size * config.data.seq_len
        self.input = StepInput(self.data, self.parallel, config.pipeline.microbatches,  # a step's batch, cut here
                               eos=lambda: self.pipe.executor.batch.document_eos)
        self.monitor = Monitor(config, plan, device=self.device, run_dir=self.run_dir)
        self.saver = (AsyncSaver(config, self.run_dir, note=self.monitor.note)  # checkpoint.async_save
                      if config.checkpoint.async_save else None)
        self.profiler = StepProfiler(config.profile, rank=self.rank, device=self.device, run_dir=self.run_dir,
                                     executor=self.pipe.executor, note=self.monitor.note)

    def resume(self, note: Note = silent) -> Optional[Restart]:
        """Collective: trainer.resume's checkpoint (model, optimizer, step/tokens, RNG), or a fresh
        start; after a restart (launch.max_restarts) the run directory's newest good checkpoint.
        Returns, on rank 0 of a restarted group, what happened before (train/restart.py)."""
        restarted, requeued = restart_count() > 0, slurm_requeues() > 0
        if requeued:
            note(f"checkpoint: requeued by SLURM ({slurm_requeues()}x): resuming from the run directory's newest "
                 f"good checkpoint")
        loaded = checkpoint.resume(self.checkpointable, self.run_dir, self.config, note=note,
                                   restarted=restarted or requeued)
        self._keep_cosine(loaded is not None, note)
        self.input.restore(self.state.data, self.state.step, note)
        return this_restart(self.tracker, self.config.layout) if restarted and self.rank == 0 else None

    def _keep_cosine(self, loaded: bool, note: Note) -> None:
        """The cosine's length: optim.decay_steps where set, else the one the run was started with
        (a resume with another trainer.max_steps says it keeps that one, and how to change it)."""
        cfg, st = self.config, self.state
        if cfg.optim.decay_steps is not None or not loaded:
            st.decay_steps = cfg.optim.decay_steps or cfg.trainer.max_steps
        elif st.decay_steps != cfg.trainer.max_steps:
            note(f"lr: the cosine keeps the length the run was started with, {st.decay_steps} steps (trainer.max_steps "
                 f"is now {cfg.trainer.max_steps}): set optim.decay_steps={cfg.trainer.max_steps} to stretch it")

    # ---- one optimizer step -------------------------------------------------------------
    def train_step(self, *, measure: bool = False) -> StepRecord:
        """One optimizer step. measure=True (a logged step; every rank alike) gathers every rank's
        timings and memory to rank 0, whose record then carries the step's measurement."""
        cfg, step = self.config, self.state.step
        lr = lr_at(step, cfg.optim, self.state.decay_steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        comm = self.pipe.executor.comm
        first_compiled = cfg.trainer.compile and comm is not None and not self._stepped
        if first_compiled:  # peers compile their layers inside this step: slow, not stuck
            comm.set_timeout(max(cfg.trainer.compile_timeout_s, cfg.pipeline.p2p_timeout_s))
        self.pipe.executor.measure = measure  # unlogged steps record nothing but the loss (runtime/recorder.py)
        self.parallel.take_stats()  # the parallel layers' counts of this step only (an eval's forwards count too)
        microbatches, docs = self.input.read(step)
        result = self.pipe.train_step(microbatches, self.input.tokens, docs)
        if first_compiled:
            comm.set_timeout(cfg.pipeline.p2p_timeout_s)
        if not self._stepped:  # from now on a collective waits on a peer no longer than a transfer does
            bound_waits([*self.groups.step_groups(), *self.pipe.sync.groups()], cfg.pipeline.p2p_timeout_s)
        self._stepped = True
        # Before the grad-norm all-reduce, which absorbs rank 0's time spent on the measurement.
        measurement = (self.monitor.gather(step + 1, result, params=self.pipe.parameters(), optimizer=self.optimizer,
                                           moe=moe_stats(self.pipe.stages.values()) if self.config.model.moe_config
                                           else None, cp=self.parallel.take_stats().get("cp"))
                       if measure else None)
        loss = result.loss if result.loss is not None else float("nan")
        # Each weight counted once: the pipeline's owner of each copy, one replica (dp_replicate
        # index 0; the shards of FSDP2 stages are distinct parts and all count), tp slices on
        # every tp rank and whole weights on tp index 0.
        owned = self.pipe.norm_parameters() if self.groups.coords.dp_replicate == 0 else []
        norm = global_grad_norm(owned, device=self.device)
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        if skipped:
            if cfg.trainer.on_nonfinite == "stop":
                raise NonFiniteLoss(
                    f"loss {loss} / grad norm {norm} at step {step + 1}: lower optim.lr, raise optim.warmup_steps, "
                    f"or set trainer.on_nonfinite=skip"
                )
            self.state.skipped += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row >= cfg.trainer.max_skipped_steps:
                raise NonFiniteLoss(
                    f"{self.skipped_in_a_row} non-finite steps in a row "
                    f"(loss {loss} / grad norm {norm} at step {step + 1}, "
                    f"trainer.max_skipped_steps={cfg.trainer.max_skipped_steps}): lower optim.lr, raise "
                    f"optim.warmup_steps, or raise trainer.max_skipped_steps")
        else:
            self.skipped_in_a_row = 0
            clip_grads(self.pipe.parameters(), norm, cfg.optim.grad_clip)
            self.optimizer.step()
        step_s = time.perf_counter() - t0
        self.state.step += 1
        self.state.tokens += self.tokens_per_step
        tokens_per_s = self.tokens_per_step / step_s
        return StepRecord(step=step + 1, loss=loss, lr=lr, grad_norm=norm, step_time_s=step_s,
                          tokens_per_s=tokens_per_s, skipped=skipped, mfu=self.monitor.mfu(tokens_per_s),
                          measurement=measurement, data=self.input.stats,
                          losses=mtp_metrics(self.pipe.executor.step_loss.part_means))

    def evaluate(self) -> float:
        losses = []
        for i in range(self.config.trainer.eval_batches):
            losses.append(self.pipe.executor.evaluate(*self.input.read(i, split="val")))
        return sum(losses) / len(losses)

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> RunSummary:
        """Resume (if asked), train to trainer.max_steps (or until a signal: train/stop.py), write
        summary.json (rank 0), close the loggers."""
        notes: list[str] = []
        if self.rank == 0:
            (self.run_dir / STOPPED).unlink(missing_ok=True)  # an earlier stop's record
        hold_presence(self.run_dir)  # until this process ends: a launcher told to stop waits for it
        with self.stop:
            restart = self.resume(note=notes.append)  # before the loggers start: they show the resumed step
            self.monitor.start(self.state.step)
            for text in notes:
                self.monitor.note(text)
            if restart is not None:
                self.monitor.event("restart", restart.line(self.state.step), failed_rank=restart.rank,
                                   failed_step=restart.step, resumed_step=self.state.step, attempt=restart.attempt)
            try:
                summary = self.monitor.summarize(self.loop())
            finally:
                self.profiler.close()  # a capture cut short by an error still writes what it has
                self.pipe.close()
                if self.rank == 0:  # after stopped.json is written: a launcher finding no .ranks reads it
                    (self.run_dir / RANKS).unlink(missing_ok=True)
            if self.rank == 0:  # whatever the loggers: the sweep table and the user read it
                (self.run_dir / "summary.json").write_text(json.dumps(summary.to_json(), indent=2) + "\n")
            self.monitor.finish(summary)
            if self.stopped is not None:
                self.stop.chain(self.stop.signum or 0)  # submitit: its requeue, after our save
        return summary

    def save(self, *, wait: bool) -> Path:
        """Collective: checkpoint the current step, in the background under checkpoint.async_save
        (wait=True: committed before returning, as at the end or on a signal)."""
        self.state.data = self.input.position()  # data.streaming's
        if self.saver is None:
            return checkpoint.save_checkpoint(self.checkpointable, self.run_dir, self.config, note=self.monitor.note)
        path = self.saver.save(self.checkpointable)
        if wait:
            self.saver.finish()
        return path

    def stop_after(self, step: int, signum: int, *, saved: Optional[Path]) -> None:
        """The ranks agreed to stop after `step` on a signal (and saved it, when checkpoints are on):
        rank 0 records where to resume (train/stop.py)."""
        name = self.config.run.name
        hint = (f"rerun the same command (run.name={name} trainer.resume=auto)" if name
                else f"resume with trainer.resume={saved}")
        if self.rank == 0:
            self.stopped = write_stopped(self.run_dir, signum=signum, step=step, checkpoint=saved, resume=hint)
            self.monitor.note(f"{signal_name(signum)}: stopped after step {step}"
                              + (f", saved {saved}" if saved else ""))
        else:
            self.stopped = {}

    def loop(self) -> RunSummary:
        """The steps still to do; returns the run's summary (before the measured part is added)."""
        cfg, monitor = self.config.trainer, self.monitor
        final_loss = val_loss = None
        st = self.state
        # the run's step 1 loss; a resume from a checkpoint without it starts from its own first step
        first_loss, first_step = st.first_loss, 1 if st.first_loss is not None else st.step + 1
        step_times: list[float] = []
        if self.state.step >= cfg.max_steps:
            monitor.note(f"nothing to do: resumed at step {self.state.step}, trainer.max_steps={cfg.max_steps}")
        while self.state.step < cfg.max_steps:
            step = self.state.step + 1
            self.tracker.begin(step)  # where a restart says the failure happened
            last = step == cfg.max_steps
            # every eval_every steps, and at the end of a run long enough to have evaluated
            evaluate = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or (last and step > cfg.eval_every))
            log = step == 1 or last or step % cfg.log_every == 0 or evaluate or step == monitor.chosen_step
            self.profiler.before(step)
            record = self.train_step(measure=log)
            self.profiler.after(step)
            step_times.append(record.step_time_s)
            self.stop.grace_s = max(10.0, 3 * max(step_times))  # a signal's wait for the step in flight
            if first_loss is None:
                first_loss = record.loss
                if step == 1:
                    st.first_loss = record.loss  # checkpoints carry it from now on
            final_loss = record.loss
            if evaluate:
                val_loss = self.evaluate()
                record = dataclasses.replace(record, val_loss=val_loss)
            monitor.progress(step)
            if record.skipped:  # every one, logged step or not: the weights did not move
                monitor.event("skipped", f"step {step}: skipped, loss {record.loss} / grad norm {record.grad_norm} not "
                              f"finite (trainer.on_nonfinite=skip): weights not updated, {self.skipped_in_a_row} in a "
                              f"row of trainer.max_skipped_steps={cfg.max_skipped_steps}", step=step,
                              loss=str(record.loss), grad_norm=str(record.grad_norm))
            if log:
                monitor.log(record)
            signum = self.stop.agreed(self.device)  # a signal any rank got stops every rank, here
            saved = None
            if checkpoint.due(step, cfg) or (signum is not None and (cfg.ckpt_every or cfg.ckpt_at_end)):
                saved = self.save(wait=last or signum is not None)
            if signum is not None:
                self.stop_after(step, signum, saved=saved)
                break
        if self.saver is not None:
            self.saver.finish()  # a background save still in flight: committed before the run ends
        steady = sorted(step_times[1:] or step_times)  # the first step pays for warm-up
        median_s = steady[len(steady) // 2] if steady else None
        return RunSummary(steps=self.state.step, first_loss=first_loss, final_loss=final_loss,
                          first_loss_step=first_step, resumed_at=st.resumed_at,
                          final_val_loss=val_loss, skipped_steps=self.state.skipped, tokens=self.state.tokens,
                          step_time_s=median_s, tokens_per_s=self.tokens_per_step / median_s if median_s else None)


def rank_main(config: Config, plan: Plan, run_dir: Path) -> dict[str, Any]:
    """Entry point of one rank (process group already initialised by the launcher)."""
    run_dir = Path(run_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config, plan, run_dir)
    summary = trainer.fit()
    stopped = {} if trainer.stopped is None else {"stopped": trainer.stopped}  # rank 0's is the record
    return {**summary.to_json(), **stopped} if trainer.rank == 0 else stopped
