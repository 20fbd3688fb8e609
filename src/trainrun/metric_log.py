"""The metrics hook: every table of training metrics the run reads goes to the writers
(``metrics.jsonl``, TensorBoard, W&B) and its log steps to the console; every timing window to
``timing.jsonl``. The console's steps/s at a log line is the step compute of the window that
line closes (``timing.StepTimer``): what checkpoints, eval and logging cost is in the summary's
wall-time split, not in the rate. Rows are written in the loop's thread: on a 2-core CPU a
second thread for them cost more than it saved at every K measured (BENCHMARKS.md, "Loop
overhead").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from trainrun.timing import StepTimer, Stopwatch, Window
from trainrun.writers import RunOutput, Table


class MetricLog:
    """A hook on tables only: log steps need no boundary of their own (rows are read one call
    late, at the boundary after a log step).

    streamed: rows already went out from inside the calls (``metrics.stream``); only the
    timing windows are written here."""

    def __init__(self, output: RunOutput, timer: StepTimer, watch: Stopwatch, batch_size: int,
                 streamed: bool = False):
        self.output = output
        self.timer = timer
        self.watch = watch
        self.batch_size = batch_size
        self.streamed = streamed
        self.last: dict[str, float] = {}  # the newest row read (the run's final metrics)
        self.ordered = OrderedOutput(self)  # eval rows and messages, timed as logging

    def on_table(self, table: Table) -> None:
        self.last = table.row(len(table.values) - 1)
        window = self.timer.windows[-1]
        self.submit(lambda: self._write(table, window))

    def _write(self, table: Table, window: Window) -> None:
        rate, note = None, " (a checkpoint was being written)" if window.during_save else ""
        if window.per_step_s > 0:
            rate = 1.0 / window.per_step_s
        elif window.first_run_s > 0:  # only first runs read: their rate, said to be that
            rate = window.first_run_steps / window.first_run_s
            note += " (first run of its program: one-time set-up included)"
        if not self.streamed:
            self.output.write_table(table, steps_per_s=rate, note=note)
        if window.steps:  # timing.jsonl holds timed windows only
            self.output.write_window(table.last, window.steps, window.per_step_s,
                                     self.batch_size)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (a write), its time counted as logging."""
        start = time.perf_counter()
        job()
        self.watch.add("log", time.perf_counter() - start)

    def flush(self) -> None:
        """Every row written is in its file (before a checkpoint; a kill right after it loses
        none of them)."""
        self.submit(self.output.flush)

    def finish(self) -> None:
        """Every row written, the writers closed (not ``close``: the loop closes hooks before
        a streamed run's last rows have arrived)."""
        self.output.close()


class OrderedOutput:
    """What the eval hook and others write, through the metric log (its time counted as
    logging in the wall-time split)."""

    def __init__(self, log: MetricLog):
        self.log = log

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        self.log.submit(lambda: self.log.output.write(step, metrics, split))

    def message(self, text: str) -> None:
        self.log.submit(lambda: self.log.output.message(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log.output, name)
