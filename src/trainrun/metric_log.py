"""The metrics hook: every table of training metrics the run reads goes to the writers
(``metrics.jsonl``, TensorBoard, W&B) and its log steps to the console; every timing window to
``timing.jsonl``. The console's steps/s at a log line is the step compute of the window that
line closes (``timing.StepTimer``): what checkpoints, eval and logging cost is in the summary's
wall-time split, not in the rate.
"""

from __future__ import annotations

import time

from trainrun.hooks import Boundary
from trainrun.timing import StepTimer, Stopwatch
from trainrun.writers import RunOutput, Table


class MetricLog:
    """streamed: rows already went out from inside the calls (``metrics.stream``); only the
    timing windows are written here."""

    def __init__(self, output: RunOutput, timer: StepTimer, watch: Stopwatch, batch_size: int,
                 streamed: bool = False):
        self.output = output
        self.timer = timer
        self.watch = watch
        self.batch_size = batch_size
        self.streamed = streamed
        self.last: dict[str, float] = {}  # the newest row read (the run's final metrics)

    def steps_to_next(self, step: int) -> None:
        return None  # log rows are read one call late: log steps need no boundary of their own

    def at_boundary(self, boundary: Boundary) -> None:
        pass

    def on_table(self, table: Table) -> None:
        start = time.perf_counter()
        window = self.timer.windows[-1]
        rate = 1.0 / window.per_step_s if window.per_step_s > 0 else None
        if not self.streamed:
            self.output.write_table(table, steps_per_s=rate,
                                    note=" (a checkpoint was being written)"
                                    if window.during_save else "")
        self.output.write_window(table.last, window.steps, window.per_step_s, self.batch_size)
        self.last = table.row(len(table.values) - 1)
        self.watch.add("log", time.perf_counter() - start)
