"""`logger=[console,...]`: what the user watches (rich).

  - a progress bar with ETA over the steps (on a terminal; piped output gets the lines only),
  - a compact metrics line every trainer.log_every steps (and at the first and last step):
    `step 10/200 loss 2.3456 ... | bubble 21.3% (sim 19.8%) | mem 12.3MB (act 4.5MB) | eta 12s`,
    with `| data 1.0k tok (loss 1.0k, pad 2.0%) web 70% code 30%` after the speed (data/: the global
    batch's tokens, those trained on, padding, and each source's share where there are several),
    on GPU `mem 12.3GB (act 4.5GB, reserved 14.1GB)` (allocated peak; reserved, with the cache),
    with `| reduce 18ms (sim 16ms)` after the bubble under data parallel (the most exposed reduce
    time of any rank, measured and simulated); mem and act are per rank (the most of any rank:
    under context parallel a rank's share of the sequence), and under context parallel
    `| cp kv 16.8MB 99ms (gathered 8.4MB)` after them (cp/: the most K/V traffic and blocked time
    of any rank, and the gathered K/V kept for backward, a part of act), and under expert parallel
    `| a2a 40ms (exposed 12ms)` (moe/: the step's all-to-all time per rank, and of it blocked in waits),
  - at the end, a per-rank table of the last step (measured vs simulated bubble, peak memory
    and its activation share, ms in F/B/W/BW and blocked in receives) and the measured
    timeline of one step (logging.trace_step), drawn by the simulator's own renderer.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from pipetrain.loggers.base import Logger, RunInfo, human_bytes
from pipetrain.loggers.tables import print_table
from pipetrain.metrics import names
from pipetrain.metrics.measure import OPS, StepMeasurement
from pipetrain.metrics.step import RunSummary, StepRecord
from pipetrain.schedules.render import render_timeline


def tokens_per_s(x: float) -> str:
    """9412.3 -> "9.4k"; a slow step keeps three digits (41.7, 0.853) instead of showing "0.0k"."""
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.3g}"


def metrics_line(record: dict[str, Any], total: int, eta_s: Optional[float]) -> str:
    """The compact line of a record's row (StepRecord.row(), names as metrics/names.py): always
    starts with "step N/M"."""
    r = record
    parts = [f"step {r['step']}/{total} loss {r[names.LOSS]:.4f}"]
    if r.get(names.VAL_LOSS) is not None:
        parts.append(f"val {r[names.VAL_LOSS]:.4f}")
    parts.append(f"lr {r[names.LR]:.1e} gnorm {r[names.GRAD_NORM]:.2f}")
    speed = f"| {tokens_per_s(r[names.TOKENS_PER_S])} tok/s {r[names.STEP_TIME] * 1e3:.0f}ms"
    if r.get(names.MFU) is not None:
        speed += f" mfu {100 * r[names.MFU]:.1f}%"
    parts.append(speed)
    if r.get(names.DATA_TOKENS) is not None:
        parts.append(data_part(r))
    if r.get(names.BUBBLE) is not None:
        parts.append(f"| bubble {100 * r[names.BUBBLE]:.1f}% (sim {100 * r[names.BUBBLE_SIM]:.1f}%)")
        reduce, reduce_sim = names.of_ranks(r, names.REDUCE), names.of_ranks(r, names.REDUCE_SIM)
        if reduce and reduce_sim:
            parts.append(f"| reduce {max(reduce):.0f}ms (sim {max(reduce_sim):.0f}ms)")
        act = max(names.of_ranks(r, names.ACTIVATIONS_GB) or [0.0])
        reserved = (f", reserved {human_bytes(r[names.PEAK_RESERVED_GB] * 1e9)}"  # on GPU
                    if r.get(names.PEAK_RESERVED_GB) is not None else "")
        parts.append(f"| mem {human_bytes(r[names.PEAK_GB] * 1e9)} (act {human_bytes(act * 1e9)}{reserved})")
    if r.get(names.CP_KV_BYTES) is not None:
        gathered = r[names.CP_GATHERED_GB]
        parts.append(f"| cp kv {human_bytes(r[names.CP_KV_BYTES])} {r[names.CP_COMM_MS]:.0f}ms"
                     + (f" (gathered {human_bytes(gathered * 1e9)})" if gathered else ""))
    if r.get(names.MOE_IMBALANCE) is not None:  # max / mean tokens per expert, mean over MoE blocks
        parts.append(f"| moe imbalance {r[names.MOE_IMBALANCE]:.2f}")
    if r.get(names.MOE_A2A_MS) is not None:  # expert parallel: all-to-all ms per rank, and of it blocked
        parts.append(f"| a2a {r[names.MOE_A2A_MS]:.0f}ms (exposed {r[names.MOE_A2A_EXPOSED_MS]:.0f}ms)")
    if eta_s is not None:
        parts.append(f"| eta {eta_s:.0f}s")
    return " ".join(parts)


def data_part(r: dict[str, Any]) -> str:
    """`| data 1.0k tok (loss 1.0k, pad 2.0%) web 70% code 30%`: the global batch's tokens, those trained on,
    the padding share, and with several sources each one's share of the tokens."""
    tokens = r[names.DATA_TOKENS]
    text = (f"| data {tokens_per_s(tokens)} tok (loss {tokens_per_s(r[names.DATA_LOSS_TOKENS])}, "
            f"pad {100 * r[names.DATA_PADDING]:.1f}%)")
    per_source = {k[len(names.DATA_TOKENS) + 1:]: v for k, v in r.items() if k.startswith(names.DATA_TOKENS + "/")}
    if len(per_source) > 1 and tokens:
        text += "".join(f" {name} {100 * n / tokens:.0f}%" for name, n in per_source.items())
    return text


def rank_table(m: StepMeasurement) -> Table:
    """Per rank: measured vs simulated bubble, peak memory, ms per op in one step; under data
    parallel the exposed reduce ms, measured and simulated."""
    rows = m.rank_rows()
    ops = [op for op in OPS if any(row[f"{op.lower()}_ms"] > 0 for row in rows)]
    dp = m.data_parallel
    which = ("" if m.is_world
             else f" of pipeline 0 (ranks {', '.join(map(str, m.global_ranks))}; every pipeline runs it)")
    table = Table(title=f"step {m.step} per rank{which}: measured vs simulated",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    heads = ["rank", "stages", "bubble\n%", "sim\n%", "peak\nmem", "of it\nact", *(f"{op}\nms" for op in ops),
             "wait\nms", *(("reduce\nms/sim",) if dp else ())]  # one column: the table stays within 80 columns
    for h in heads:
        table.add_column(h, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            str(row["rank"]), "|".join(map(str, row["stages"])), f"{100 * row['bubble']:.1f}",
            f"{100 * row['simulated_bubble']:.1f}", human_bytes(row["peak_memory_bytes"]),
            human_bytes(row["activation_bytes"]), *(f"{row[f'{op.lower()}_ms']:.1f}" for op in ops),
            f"{row['wait_ms']:.1f}",
            *((f"{row['reduce_exposed_ms']:.0f}/{row['simulated_reduce_exposed_ms']:.0f}",) if dp else ()),
        )
    table.add_row("mean", "", f"{100 * m.bubble_mean:.1f}", f"{100 * m.simulated.bubble_fraction_mean:.1f}",
                  "", "", *("" for _ in ops), "", *(("",) if dp else ()), style="bold")
    return table


class ConsoleLogger(Logger):
    def start(self, info: RunInfo) -> None:
        super().start(info)
        self.console = Console()
        self.t0 = time.perf_counter()
        self.bar: Optional[Progress] = None
        if self.console.is_terminal:  # a live bar only where it can redraw in place
            self.bar = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                console=self.console, transient=True)
            self.task = self.bar.add_task("train", total=info.max_steps, completed=info.start_step)
            self.bar.start()

    def progress(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def log(self, record: StepRecord) -> None:
        done = record.step - self.info.start_step
        eta = (time.perf_counter() - self.t0) / max(1, done) * (self.info.max_steps - record.step)
        # soft_wrap: one line per step even where the output is a narrow pipe or log file
        self.console.print(metrics_line(record.row(), self.info.max_steps, eta), highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        # soft_wrap: a checkpoint path stays on one line, as the plain print that showed it did
        self.console.print(text, highlight=False, soft_wrap=True)

    def finish(self, summary: RunSummary, last: Optional[StepRecord], chosen: Optional[StepRecord]) -> None:
        if self.bar is not None:
            self.bar.stop()
        if last is not None and last.measurement is not None:
            print_table(self.console, rank_table(last.measurement))
        if chosen is not None and chosen.measurement is not None and self.info.config.logging.timeline:
            m = chosen.measurement
            self.console.print(f"measured timeline of step {m.step} (blocks: compute; dots: idle or waiting "
                               f"for a peer; all ranks on one clock)", highlight=False, soft_wrap=True)
            self.console.print(render_timeline(m.measured, width=self.info.config.sim.timeline_width or None))
        first, final = summary.first_loss, summary.final_loss
        if first is None or final is None:
            return
        bubble = ""
        if summary.bubble_fraction_mean is not None and summary.simulated_bubble_fraction is not None:
            bubble = (f"; bubble {100 * summary.bubble_fraction_mean:.1f}% measured vs "
                      f"{100 * summary.simulated_bubble_fraction:.1f}% simulated")
        if summary.reduce_exposed_ms is not None and summary.simulated_reduce_exposed_ms is not None:
            bubble += (f"; exposed reduce {summary.reduce_exposed_ms:.1f} ms measured vs "
                       f"{summary.simulated_reduce_exposed_ms:.1f} ms simulated")
        change = (1 - final / first) * 100 if first else 0.0
        trend = f"{change:.0f}% lower" if change >= 0 else f"{-change:.0f}% higher"
        resumed = f" (resumed at step {summary.resumed_at})" if summary.resumed_at else ""
        of = f" (step {summary.first_loss_step})" if summary.first_loss_step != 1 else ""
        self.console.print(f"done: {summary.steps} steps{resumed}, "
                           f"loss {first:.4f}{of} -> {final:.4f} ({trend}){bubble}; "
                           f"{self.info.run_dir}", highlight=False, soft_wrap=True)
