"""`pipetrain`: compose the Hydra config, turn it into typed dataclasses, run.

What composing needs (schemas, recipes, resolvers, the typed conversion) is in compose.py,
shared with the sbatch renderer and the tests; this module is only the command.

User mistakes end as one clear message and a non-zero exit (set HYDRA_FULL_ERROR=1
for the traceback); a misspelt key or option gets the nearest name (compose.check_overrides).
What the terminal shows of a run is kept in its run directory's pipetrain.log (runlog.py).
Configs ship inside the package (`pipetrain.conf`), so the command works from any directory
after `pip install .` or `pip install -e .`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, ContextManager

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipetrain.compose import CONF_DIR, check_overrides, check_recipe_args, config_dirs, register_all, to_config
from pipetrain.config import Config, Mode
from pipetrain.config.finetune import with_family
from pipetrain.launch import RankFailedError, RunStopped
from pipetrain.launch.forkserver import prestart_early
from pipetrain.launch.rundir import RunLock, check_args
from pipetrain.sweep import check_sweep, sweep_overrides

USER_ERRORS = (ValueError, TypeError, FileNotFoundError)
LOCKING_MODES = ("train", "eval", "export")  # the modes that hold the run directory's lock (run() below)
# Hydra's flags that compose something else than conf/config.yaml: check_overrides stands aside
OTHER_CONFIG = ("--config-path", "-cp", "--config-name", "-cn", "--experimental-rerun")


def run(config: Config, run_dir: Path) -> Any:
    from rich.console import Console

    from pipetrain.launch import launch, prestart
    from pipetrain.launch.resolvers import process_rank
    from pipetrain.launch.rundir import check_writable
    from pipetrain.planner.auto import choose, report, wants_plan
    from pipetrain.simulate_cmd import plan_and_simulate, run_simulate

    if config.mode is Mode.plan:
        from pipetrain.planner.cmd import run_plan

        return run_plan(config, run_dir)
    # Under torchrun / SLURM every process is a rank and composes the config: one of them reports.
    quiet = process_rank(config.cluster.name) != 0
    console = Console(quiet=quiet)
    planned = None
    if wants_plan(config):  # schedule=auto: the planner's best row is what runs (or is simulated)
        config, planned = choose(config, run_dir, console)
    if config.mode is Mode.simulate:
        return run_simulate(config, run_dir)
    # Train, eval, export: everything is checked (and simulated) here, before any process starts.
    if not quiet:  # the run and checkpoint directories take files (no torch needed: before the start-up)
        saves = config.mode is Mode.train and bool(config.trainer.ckpt_every or config.trainer.ckpt_at_end)
        check_writable(run_dir, checkpoints=saves)
        lock = RunLock(run_dir)  # the CLI holds it (LockRunDir); a caller without Hydra's run is refused here
        holder = lock.check()
        if lock.ours(holder) and "took_over" in holder:
            console.print(f"run directory: took over the lock of {holder['took_over']}, which is gone", markup=False,
                          highlight=False)
    if config.mode is not Mode.export:
        prestart(config)  # the ranks' start-up (torch's import) runs beside the checks, before ours
    from pipetrain.execution import run_device
    from pipetrain.train.checkpoint_meta import preflight

    preflight(config, run_dir)  # a bad trainer.resume fails here, not in every rank
    if config.model.pretrained:  # the one path of the launcher that imports torch before ranks
        from pipetrain.models.hf import check_pretrained

        check_pretrained(config.model)  # a missing, extra or mis-shaped key too (the model's keys, built on meta)
    from pipetrain.train.token_check import check_token_ids

    check_token_ids(config)  # a token id beyond model.vocab_size in the files the run reads
    changes = getattr(config.model, "pretrained_changes", None)
    if changes:
        console.print(f"model.pretrained={config.model.pretrained}: its config.json sets {', '.join(changes)}",
                      markup=False, highlight=False)
    from pipetrain.config.finetune import header_lines

    for line in header_lines(config.model.pretrained, config.data, config.optim):  # tokenizer, defaults
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # one line each, whatever the width
    if config.mode is Mode.export:
        from pipetrain.train.export import run_export

        return run_export(config, run_dir, note=lambda text: console.print(text, markup=False, highlight=False))
    plan, _ = plan_and_simulate(config, run_dir, console, timeline=False, write=not quiet)
    if run_device(config) == "cpu":
        from pipetrain.launch.host_memory import check_host_memory

        check_host_memory(config, plan)  # a model too large for this machine: one line, before any rank starts
    if config.mode is Mode.eval:
        result = launch(config, plan, run_dir, entry="pipetrain.train.evaluate:rank_eval")
        if "submitted" in result:  # cluster=slurm from a login node: the job evaluates
            return result
        from pipetrain.train.evaluate import EVAL_FILE

        console.print(f"eval: loss {result['loss']:.6f} over {result['tokens']:,} tokens of {result['file']} "
                      f"({result['tokens_per_s']:,.0f} tokens/s) -> {run_dir / EVAL_FILE}",
                      markup=False, highlight=False)
        return result
    result = launch(config, plan, run_dir)
    if planned is not None and not quiet:
        report(planned, run_dir, console, allocator_peak=run_device(config) == "cuda")
    return result


def sweep_job(config: Config, sweep_dir: str, overrides: list[str]) -> None:
    """A job of `pipetrain -m`: its wandb run in the sweep's group, and its timelines left out
    (12 jobs drew 500 lines before the comparison table; each job's summary row is in that
    table, its timeline in schedule_trace.json / trace.json) unless the command line asks."""
    if config.logging.wandb_group is None:
        config.logging.wandb_group = sweep_group(sweep_dir)
    asked = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if "sim.timeline" not in asked:
        config.sim.timeline = False
    if "logging.timeline" not in asked:
        config.logging.timeline = False


def sweep_group(sweep_dir: str) -> str:
    """multirun/2026-01-02/10-11-12 -> "multirun/2026-01-02/10-11-12" (its last three parts)."""
    return "/".join(Path(sweep_dir).parts[-3:])


def _fail(err: BaseException) -> None:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    print(f"pipetrain: error: {err}", file=sys.stderr)
    sys.exit(2)


class LockRunDir(Callback):
    """Hydra writes .hydra/ into the run directory before the task starts: the directory's lock
    (launch/rundir.py: RunLock) is taken here, before that (conf/config.yaml: hydra.callbacks), so
    that of two runs started at once in one directory the one refused writes nothing there (not
    even its .hydra/config.yaml over the other's). Held until this process ends; run() and launch()
    find it held by this process. A submitting run (cluster=slurm on a login node) only checks it:
    its job, not this process, holds the lock."""

    def __init__(self) -> None:
        self.lock: RunLock | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from pipetrain.launch.env import in_slurm_job
        from pipetrain.launch.resolvers import process_rank

        mode = OmegaConf.select(config, "mode")
        cluster = str(config.cluster.name)
        if str(getattr(mode, "name", mode)) not in LOCKING_MODES or process_rank(cluster) != 0:
            return
        lock = RunLock(Path(config.hydra.run.dir).resolve())  # a takeover's note: run() prints it, into pipetrain.log
        try:
            if cluster == "slurm" and not in_slurm_job():
                lock.check()
                return
            lock.acquire()
        except ValueError as e:
            _fail(e)
        except OSError as e:
            _fail(ValueError(f"run directory {lock.path.parent}: cannot lock it ({e.strerror or e}): "
                             f"set run.name or hydra.run.dir to a directory you can write"))
        self.lock = lock
        atexit.register(lock.release)  # a run that ends in sys.exit (a refusal) skips on_run_end

    def on_run_end(self, **kwargs: Any) -> None:
        if self.lock is not None:
            self.lock.release()
            atexit.unregister(self.lock.release)
            self.lock = None


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> Any:
    hydra_cfg = HydraConfig.get()
    with kept_console(cfg, Path(hydra_cfg.runtime.output_dir)):
        try:
            config = to_config(cfg)
            if hydra_cfg.mode == RunMode.MULTIRUN:
                sweep_job(config, hydra_cfg.sweep.dir, list(hydra_cfg.overrides.task))
            return run(config, Path(hydra_cfg.runtime.output_dir))
        except USER_ERRORS as e:
            _fail(_unwrap(e))
        except RankFailedError as e:  # the failing rank's one-line message; its traceback is on disk
            _fail(e)
        except RunStopped as e:  # SIGTERM / SIGINT: the step was saved; one line says where to resume
            print(f"pipetrain: {e}", file=sys.stderr)
            sys.exit(e.exit_code)


def kept_console(cfg: DictConfig, run_dir: Path) -> ContextManager[object]:
    """The run directory's pipetrain.log (runlog.py), written by the process that reports: the
    launcher (cluster=local; its ranks print through it) or rank 0 where every process is a rank.
    A sweep job's log starts with that job's overrides."""
    from pipetrain.launch.resolvers import process_rank
    from pipetrain.runlog import console_log

    if process_rank(str(OmegaConf.select(cfg, "cluster.name", default="local"))) != 0:
        return contextlib.nullcontext()
    hydra_cfg = HydraConfig.get()
    argv = list(hydra_cfg.overrides.task) if hydra_cfg.mode == RunMode.MULTIRUN else sys.argv[1:]
    return console_log(run_dir, argv)


def _unwrap(err: BaseException) -> BaseException:
    """OmegaConf wraps exceptions raised in __post_init__; show the user the original message."""
    while err.__cause__ is not None and isinstance(err.__cause__, USER_ERRORS):
        err = err.__cause__
    return err


def version() -> str:
    """`pipetrain --version`: this package's (Hydra's own flag would print Hydra's)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return f"pipetrain {installed('pipetrain')}"
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "pipetrain (not installed: pip install -e .)"


def main() -> None:
    argv = sys.argv[1:]
    if "--version" in argv:
        print(version())
        return
    argv = sys.argv[1:] = with_family(argv)  # model.pretrained=DIR alone: the preset of DIR's family
    prestart_early(argv)  # the ranks' fork server, before Hydra composes, where the command line says train
    register_all()
    try:
        check_recipe_args(argv)
        if not any(a.partition("=")[0] in OTHER_CONFIG for a in argv):  # not with another primary config
            check_overrides(sweep_overrides(argv), config_dirs(argv))  # a typo: one line, with the nearest name
        if "--help" in argv or "-h" in argv:
            from pipetrain.help import render

            print(render(argv), end="")
            return
        if "-m" in argv or "--multirun" in argv:  # every job checked before any starts
            check_sweep(argv, config_dirs(argv))
        check_args(argv)  # a run directory that is a file or read-only, before Hydra sets up its log there
    except USER_ERRORS as e:
        _fail(_unwrap(e))
    _hydra_main()
    if "torch" in sys.modules:  # a run that imported torch: a quicker exit (the console script's, and _cli_runs')
        import gc

        # The interpreter's last collection walks every object torch's import made: ~0.5 s of a 1-step
        # run's wall time on a 2-core machine (py-spy, bench/startup.py). Frozen objects are left to
        # the process's end; the ones reference counts free are freed as before.
        gc.freeze()


if __name__ == "__main__":
    main()
