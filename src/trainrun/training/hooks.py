"""What a run does between its jitted calls: hooks, acting at call boundaries.

After each call of up to K steps the host has a *boundary*, and every hook sees every boundary,
in the run's order (metrics, profile, eval, preemption, user callbacks, checkpoint). Hooks say
when they next need one (``steps_to_next``, ``poll``), so call sizes come from the hooks and the
calls between boundaries run back to back. Metrics are read one call late;
``Boundary.sync()`` reads up to this very step. Why, and how a boundary is chosen:
docs/internals.md, "Hooks and call boundaries".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from trainrun.program.state import TrainState
from trainrun.reporting.table import Table
from trainrun.training.metrics_reader import MetricsReader, PendingCall


class Hook:
    """What acts at call boundaries. Subclass and override what the hook does; the runner
    calls only the methods a hook overrides (looked up once), so a hook pays only for what it
    does on a step short enough that every call counts (BENCHMARKS.md, "Loop overhead")."""

    # False: ``at_boundary`` needs only the boundaries ``steps_to_next`` and ``poll`` ask for,
    # and the run's last; a hook with ``at_boundary`` or ``before_call`` and True gets every
    # call's.
    every_boundary: bool = True

    def steps_to_next(self, step: int) -> int | None:
        """Steps from ``step`` until this hook needs a boundary; None: none of its own."""
        return None

    def poll(self, step: int) -> bool:
        """After each call: whether the hook needs a boundary at ``step`` for a reason
        ``steps_to_next`` could not foresee (a signal, a clock); the same answer on every
        host."""
        return False

    def before_call(self, step: int, k: int) -> None:
        """Before the call that runs steps ``step + 1 .. step + k``."""

    def on_table(self, table: Table) -> None:
        """Every table of training metrics, in step order, as it is read."""

    def at_boundary(self, boundary: Boundary) -> None:
        """Act at a boundary (most hooks return at once on most boundaries)."""

    def close(self) -> None:
        """Once, however the run ends."""


def overrides(hook: Hook, name: str) -> bool:
    """Whether ``hook``'s class implements ``name`` itself rather than inheriting the no-op."""
    return getattr(type(hook), name) is not getattr(Hook, name)


class Call(NamedTuple):
    """A jitted call of the run: steps ``first_step + 1 .. first_step + steps``, dispatched at
    ``dispatched_at`` (``time.perf_counter`` seconds); ``first_run``: the first call of its
    program (which is compiled then, or was at set-up)."""

    first_step: int
    steps: int
    dispatched_at: float
    first_run: bool


class Boundary:
    """The host's view of the run between two calls.

    step: steps done; total: the run's ``steps``.
    table: training metrics read at this boundary (rows of steps up to ``step``), or None.
    eval: this boundary's evaluation (``{"loss": ...}``), or None.
    saved: the checkpoint saved at this boundary, or None.
    calls: the calls run since the previous boundary (``Call``), in step order.
    """

    # One is made per call: the fields most boundaries leave alone are class defaults, set on
    # the instance only when a hook sets them.
    table: Table | None = None
    eval: dict[str, float] | None = None
    saved: Any = None
    stop_reason: str | None = None
    preempted: bool = False
    _state: TrainState | None = None
    _pending: Sequence[PendingCall] = ()  # the calls since the previous boundary
    commit_wait: Callable[[], None] | None = None  # waits for ``saved`` to commit

    def __init__(self, step: int, total: int, runner: HookRunner, carried: Any):
        self.step = step
        self.total = total
        self._runner = runner
        self._carried = carried  # the state as the calls carry it

    @property
    def calls(self) -> list[Call]:
        """The calls run since the previous boundary, in step order: how many steps each ran,
        when it was dispatched, and whether it was its program's first."""
        return [Call(c.first_step, c.steps, c.dispatched_at, c.first_run) for c in self._pending]

    @property
    def last(self) -> bool:
        """The run ends at this boundary: its final step, or a stop was asked for."""
        return self.step >= self.total or self.stop_reason is not None

    def sync(self) -> None:
        """Read every dispatched step's metrics (waits for the device)."""
        self._runner.publish(self, self._runner.reader.read())

    def state(self) -> TrainState:
        """The state after ``step`` steps (after ``sync``). Its arrays may be donated by the
        next call: use them within this boundary."""
        if self._state is None:
            self.sync()
            self._state = self._runner.state_of(self._carried)
        return self._state

    def params(self) -> Any:
        """A copy of the params after ``step`` steps, safe to keep after the boundary."""
        return self._runner.params_copy(self.state())

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint saved at this boundary (``saved``) is committed."""
        if self.saved is not None and self.commit_wait is not None:
            self.commit_wait()

    def stop(self, reason: str, *, preempted: bool = False) -> None:
        """End the run at this boundary: the checkpoint hook saves this step, and the run
        finishes (``preempted``: stops to be resumed)."""
        if self.stop_reason is None:
            self.stop_reason, self.preempted = reason, preempted


class HookRunner:
    """Runs a list of hooks: call sizes from their ``steps_to_next``, then their boundaries."""

    def __init__(self, hooks: list[Hook], steps_per_call: int, total: int,
                 reader: MetricsReader, state_of: Callable[[Any], TrainState],
                 params_copy: Callable[[TrainState], Any]):
        self.hooks = hooks
        self.steps_per_call = steps_per_call
        self.total = total
        self.reader = reader
        self.state_of = state_of  # the TrainState in a carried state (``CompiledSteps.state``)
        self.params_copy = params_copy
        self.sinks = [h.on_table for h in hooks if overrides(h, "on_table")]
        self.before = [h.before_call for h in hooks if overrides(h, "before_call")]
        self.schedules = [h.steps_to_next for h in hooks if overrides(h, "steps_to_next")]
        self.acting = [h.at_boundary for h in hooks if overrides(h, "at_boundary")]
        self.polls = [h.poll for h in hooks if overrides(h, "poll")]
        self.every_call = any(h.every_boundary for h in hooks
                              if overrides(h, "at_boundary") or overrides(h, "before_call"))

    def call_size(self, step: int) -> int:
        """Steps in the next call: K, cut at the nearest step a hook needs a boundary."""
        k = min(self.steps_per_call, self.total - step)
        for steps_to_next in self.schedules:
            wanted = steps_to_next(step)
            if wanted and wanted < k:
                k = wanted
        return k

    def calls_to_boundary(self, step: int, k: int) -> int:
        """Calls of ``k`` steps from ``step`` before the next boundary a hook or a read needs:
        1 when some hook needs every call's; else up to the nearest step a hook named and to
        the read after the next log step (``MetricsReader.calls_to_read``)."""
        if self.every_call:
            return 1
        calls = (self.total - step) // k
        for steps_to_next in self.schedules:
            wanted = steps_to_next(step)
            if wanted:
                calls = min(calls, wanted // k)
        return max(1, min(calls, self.reader.calls_to_read(step, k)))

    def poll(self, step: int) -> bool:
        """Whether a hook needs a boundary at ``step`` (a signal, a clock)."""
        for poll in self.polls:  # noqa: SIM110  # asked after every call: no generator
            if poll(step):
                return True
        return False

    def before_call(self, step: int, k: int) -> None:
        for before in self.before:
            before(step, k)

    def after_calls(self, calls: list[PendingCall], carried: Any) -> Boundary:
        """The boundary after ``calls`` (run back to back): the metrics of the calls before the
        last read if a log point is due (one call late), then every hook in order."""
        last = calls[-1]
        boundary = Boundary(last.first_step + last.steps, self.total, self, carried)
        boundary._pending = calls
        for call in calls[:-1]:
            self.reader.add(call)
        if self.reader.due():
            self.publish(boundary, self.reader.read())
        self.reader.add(last)
        for at_boundary in self.acting:
            at_boundary(boundary)
        return boundary

    def publish(self, boundary: Boundary, table: Table | None) -> None:
        if table is None:
            return
        for sink in self.sinks:
            sink(table)
        boundary.table = joined([boundary.table, table])

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()


def joined(tables: Sequence[Table | None]) -> Table | None:
    """Consecutive tables as one (None when there are none)."""
    present = [t for t in tables if t is not None]
    if len(present) < 2:
        return present[0] if present else None
    return Table(present[0].first, present[0].names,
                 np.concatenate([t.values for t in present]))
