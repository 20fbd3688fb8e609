"""The metrics hook: every table of training metrics the run reads goes to the writers
(``metrics.jsonl``, TensorBoard, W&B) and its log steps to the console; every timing window to
``timing.jsonl``. The console's steps/s at a log line is the step compute of the window that
line closes (``timing.StepTimer``): what checkpoints, eval and logging cost is in the summary's
wall-time split, not in the rate.

With a ``worker`` (``host_worker.py``) the rows are written on its thread while the next call
computes (about 6.5 µs a step for the two files on the default MLP). Everything else that writes
(eval rows, messages) goes through the same queue, so files and console keep their order;
``flush`` waits for the queue (before a checkpoint) and is what counts as logging then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from trainrun.host_worker import HostWorker
from trainrun.timing import StepTimer, Stopwatch, Window
from trainrun.writers import RunOutput, Table


class MetricLog:
    """A hook on tables only: log steps need no boundary of their own (rows are read one call
    late, at the boundary after a log step).

    streamed: rows already went out from inside the calls (``metrics.stream``); only the
    timing windows are written here. worker: write on its thread (``finish`` stops it)."""

    def __init__(self, output: RunOutput, timer: StepTimer, watch: Stopwatch, batch_size: int,
                 streamed: bool = False, worker: HostWorker | None = None):
        self.output = output
        self.timer = timer
        self.watch = watch
        self.batch_size = batch_size
        self.streamed = streamed
        self.last: dict[str, float] = {}  # the newest row read (the run's final metrics)
        self.ordered = OrderedOutput(self)  # eval rows and messages, in order with the rows
        self.worker = worker

    def on_table(self, table: Table) -> None:
        self.last = table.row(len(table.values) - 1)
        window = self.timer.windows[-1]
        self.submit(lambda: self._write(table, window))

    def _write(self, table: Table, window: Window) -> None:
        rate = 1.0 / window.per_step_s if window.per_step_s > 0 else None
        if not self.streamed:
            self.output.write_table(table, steps_per_s=rate,
                                    note=" (a checkpoint was being written)"
                                    if window.during_save else "")
        self.output.write_window(table.last, window.steps, window.per_step_s, self.batch_size)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (a write) now, or queue it behind the rows already handed over."""
        if self.worker is None:
            start = time.perf_counter()
            job()
            self.watch.add("log", time.perf_counter() - start)
            return
        self.worker.submit(job)

    def flush(self) -> None:
        """Every row handed over is in its file (before a checkpoint; a kill right after it
        loses none of them)."""
        start = time.perf_counter()
        if self.worker is not None:
            self.worker.wait()
        self.output.flush()
        self.watch.add("log", time.perf_counter() - start)

    def finish(self) -> None:
        """Every row written, the thread stopped, the writers closed (not ``close``: the loop
        closes hooks before a streamed run's last rows have arrived)."""
        if self.worker is not None:
            start = time.perf_counter()
            worker, self.worker = self.worker, None
            worker.stop()
            self.watch.add("log", time.perf_counter() - start)
        self.output.close()


class OrderedOutput:
    """What the eval hook and others write, through the metric log (in order with its rows)."""

    def __init__(self, log: MetricLog):
        self.log = log

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        self.log.submit(lambda: self.log.output.write(step, metrics, split))

    def message(self, text: str) -> None:
        self.log.submit(lambda: self.log.output.message(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.log.output, name)
