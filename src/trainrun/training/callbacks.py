"""User callbacks: hooks a user passes to ``trainrun.run(..., callbacks=[...])``.

A callback runs between calls, in step order, after the run's own metrics, profile, eval and
preemption hooks and before its checkpoint hook: it sees the step's metrics and evaluation, may
ask for a copy of the params, and may end the run (the step is then saved). ``every`` asks for
boundaries at multiples of a step count. Ready ones: ``EarlyStopping`` on an eval metric and
``MetricLogger`` (every row to a function of yours); keeping the best checkpoint is a config
key, ``checkpoint.keep_best``. What a callback sees and when: docs/internals.md, "Hooks and
call boundaries".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from trainrun.reporting.table import Table
from trainrun.reporting.timing import Stopwatch
from trainrun.training.hooks import Boundary, Call, Hook, joined

__all__ = ["Boundary", "Call", "Callback", "CallbackHook", "EarlyStopping", "MetricLogger"]


class Callback:
    """Subclass and override ``at_boundary``.

    every: boundaries at every multiple of this many steps (calls end there, and the metrics
        of those steps are read before the callback runs); 0: none of its own.
    every_boundary: with ``every`` 0, a boundary after every call (True), or only the ones the
        run has anyway (False). Every row still reaches ``boundary.table`` once, in order.
    """

    every: int = 0
    every_boundary: bool = True

    def at_boundary(self, boundary: Boundary) -> None:
        """Called at every boundary, in step order."""

    def on_checkpoint(self, boundary: Boundary) -> None:
        """Called once a checkpoint's save has started (``boundary.saved``, its directory),
        after ``at_boundary``; ``boundary.wait_for_checkpoint()`` waits for its commit."""

    def close(self) -> None:
        """Called once when the run ends, however it ends."""


class CallbackHook(Hook):
    """A ``Callback`` as one of the run's hooks. Its ``boundary.table`` holds the rows read
    since its previous boundary (a hook after it may read more: those come next time), so
    it sees every row once, in order."""

    def __init__(self, callback: Callback, watch: Stopwatch | None = None):
        self.callback = callback
        self.every = int(getattr(callback, "every", 0) or 0)
        self.every_boundary = not self.every and getattr(callback, "every_boundary", True)
        self.watch = watch or Stopwatch()
        self.unseen: list[Table] = []

    def steps_to_next(self, step: int) -> int | None:
        return self.every - step % self.every if self.every else None

    def on_table(self, table: Table) -> None:
        self.unseen.append(table)

    def at_boundary(self, boundary: Boundary) -> None:
        if boundary.last or (self.every and boundary.step % self.every == 0):
            boundary.sync()  # the rows of the steps it asked for (or of all) are in the table
        read, boundary.table = boundary.table, joined(self.unseen)
        self.unseen = []
        start = time.perf_counter()
        try:
            self.callback.at_boundary(boundary)
        finally:
            boundary.table = read
            self.watch.add("callbacks", time.perf_counter() - start)

    def close(self) -> None:
        self.callback.close()


class EarlyStopping(Callback):
    """Stop when an eval metric has not improved for ``patience`` evaluations.

    metric: ``eval/<name>`` (``eval/loss``, ``eval/accuracy``, ...); needs ``eval.every``.
    mode: ``min`` (a loss) or ``max`` (an accuracy).
    min_delta: an improvement smaller than this does not count.
    """

    every_boundary = False  # acts at evaluations only, which are boundaries anyway

    def __init__(self, metric: str = "eval/loss", patience: int = 3, *, mode: str = "min",
                 min_delta: float = 0.0):
        split, _, self.name = metric.partition("/")
        if split != "eval" or not self.name or mode not in ("min", "max") or patience < 1:
            raise ValueError(f"EarlyStopping({metric!r}, patience={patience}, mode={mode!r}): "
                             "give an eval metric (eval/loss), patience >= 1, mode min or max")
        self.metric, self.patience, self.mode, self.min_delta = metric, patience, mode, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.best_step: int | None = None
        self.waited = 0

    def at_boundary(self, boundary: Boundary) -> None:
        if boundary.eval is None:
            return
        value = boundary.eval[self.name]
        gain = self.best - value if self.mode == "min" else value - self.best
        if gain > self.min_delta or self.best_step is None:
            self.best, self.best_step, self.waited = value, boundary.step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            boundary.stop(f"early stopping: {self.metric} has not improved on {self.best:.6g} "
                          f"(step {self.best_step}) for {self.patience} evaluations")


class MetricLogger(Callback):
    """Every metrics row the run reads, handed to ``write(step, split, metrics)``: training rows
    (``split`` "train") as they are read, in step order, each once, and evaluations ("eval").
    For a tracker of your own; ``names`` limits the metrics passed."""

    every_boundary = False  # rows come at the reads, which are boundaries anyway

    def __init__(self, write: Callable[[int, str, dict[str, float]], None],
                 names: list[str] | None = None):
        self.write = write
        self.names = names

    def at_boundary(self, boundary: Boundary) -> None:
        if boundary.table is not None:
            for step, row in boundary.table.rows():
                self.write(step, "train", self._pick(row))
        if boundary.eval is not None:
            self.write(boundary.step, "eval", self._pick(boundary.eval))

    def _pick(self, row: dict[str, float]) -> dict[str, float]:
        return row if self.names is None else {n: row[n] for n in self.names if n in row}
