"""The metrics hook: every table of training metrics the run reads goes to the writers
(``metrics.jsonl``, TensorBoard, W&B) and its log steps to the console; every timing window to
``timing.jsonl``. The console's steps/s at a log line is the step compute of the window that
line closes (``timing.StepTimer``), with the parts of those steps made on the host (a
reinforcement-learning run's rollouts: ``timing.HostParts``).

Every write goes through the log's ``Writes``: ``InlineWrites`` writes in the loop's thread;
another may write elsewhere, in order (``fast/writer_thread.py``), so the loop waits for it
before a checkpoint (``flush``: rows up to it survive a kill), at the end (``finish``) and
however the loop ends (``close``), and a failed write is raised in the loop's thread at the
next hand-over or wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from trainrun.reporting.run_output import RunOutput
from trainrun.reporting.table import Table
from trainrun.reporting.timing import HostParts, StepTimer, Stopwatch, Window
from trainrun.training.hooks import Hook


class Writes(Protocol):
    """Where the log's jobs (writes) run, each after every job handed before it."""

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job``, or queue it; may raise the failure of an earlier job."""

    def wait(self) -> None:
        """Every job handed over done; raises the first that failed."""

    def close(self) -> None:
        """The jobs handed over run to their end; raises nothing."""


class InlineWrites:
    """Each job run at once, in the loop's thread."""

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class MetricLog(Hook):
    """A hook on tables only: log steps need no boundary of their own (rows are read one call
    late, at the boundary after a log step).

    streamed: rows already went out from inside the calls (``metrics.stream``); only the
    timing windows are written here.
    writes: where the writes run (``InlineWrites`` when None).
    parts: the parts of each step made on the host (a reinforcement-learning run's rollouts):
    the console's steps/s counts them beside the update."""

    def __init__(self, output: RunOutput, timer: StepTimer, watch: Stopwatch, batch_size: int,
                 streamed: bool = False, writes: Writes | None = None,
                 parts: HostParts | None = None):
        self.output = output
        self.timer = timer
        self.watch = watch
        self.batch_size = batch_size
        self.streamed = streamed
        self.last: dict[str, float] = {}  # the newest row read (the run's final metrics)
        self.ordered = OrderedOutput(self)  # eval rows and messages, timed as logging
        self.writes = writes or InlineWrites()
        self.parts = parts

    def on_table(self, table: Table) -> None:
        self.last = table.row(len(table.values) - 1)
        window = self.timer.windows[-1]
        self.submit(lambda: self._write(table, window))

    def _write(self, table: Table, window: Window) -> None:
        rate, note = None, " (a checkpoint was being written)" if window.during_save else ""
        if window.per_step_s > 0:
            rate = 1.0 / (window.per_step_s + self._host_per_step_s(window))
        elif window.first_run_s > 0:  # only first runs read: their rate, said to be that
            rate = window.first_run_steps / window.first_run_s
            note += " (first run of its program: one-time set-up included)"
        if not self.streamed:
            self.output.write_table(table, steps_per_s=rate, note=note)
        if window.steps:  # timing.jsonl holds timed windows only
            self.output.write_window(table.last, window.steps, window.per_step_s,
                                     self.batch_size)

    def _host_per_step_s(self, window: Window) -> float:
        """Seconds per step made on the host before the updates of ``window``'s steps."""
        if self.parts is None:
            return 0.0
        first = window.last_step - window.steps - window.first_run_steps + 1
        return self.parts.per_step_s(first, window.last_step)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (a write) after every job handed before it (``Writes.submit``). The
        loop's time here is logging."""
        start = time.perf_counter()
        try:
            self.writes.submit(job)
        finally:
            self.watch.add("log", time.perf_counter() - start)

    def wait(self) -> None:
        """Every job handed over done; raises the first that failed. Waiting is logging."""
        start = time.perf_counter()
        try:
            self.writes.wait()
        finally:
            self.watch.add("log", time.perf_counter() - start)

    def flush(self) -> None:
        """Every row written is in its file (before a checkpoint; a kill right after it loses
        none of them)."""
        self.submit(self.output.flush)
        self.wait()

    def close(self) -> None:
        """The loop has ended, however it ended: the jobs handed over run to their end and the
        writes stop. Raises nothing (an error ending the loop is the one reported);
        ``finish`` raises a failed write. Waiting for those jobs is logging."""
        start = time.perf_counter()
        self.writes.close()
        self.watch.add("log", time.perf_counter() - start)

    def finish(self) -> None:
        """Every row written, the writers closed (the metrics stream's too: the loop closes
        hooks before a streamed run's last rows have arrived, so only here)."""
        self.close()
        self.wait()
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

    def completions(self, records: list[dict[str, Any]]) -> None:
        """Sampled completions to ``completions.jsonl``."""
        self.log.submit(lambda: self.log.output.write_completions(records))
