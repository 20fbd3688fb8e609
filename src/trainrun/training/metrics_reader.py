"""Reading the metrics of dispatched calls: a window of calls at a time, in one transfer, at log
and sync points only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.program.compiled import CompiledSteps
from trainrun.reporting.table import Table
from trainrun.reporting.timing import StepTimer

MAX_PENDING_CALLS = 256  # bounds how stale unread metrics get between log points


@dataclasses.dataclass(slots=True)
class PendingCall:
    """A dispatched call whose metrics have not been read yet."""

    first_step: int  # updates done before this call
    steps: int
    packed: jax.Array | np.ndarray  # [n_metrics] (K=1) or [steps, n_metrics]
    dispatched_at: float
    returned_at: float  # when the call returned (inline calls: when it was computed)
    during_save: bool = False  # a checkpoint was being written in the background
    first_run: bool = False  # the first call of its program (one-time runtime set-up)


@jax.jit
def _stack(packed: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([p.reshape(-1, p.shape[-1]) for p in packed])


class MetricsReader:
    """Reads the metrics of dispatched calls in batches, at log and sync points only.

    The pending calls' metrics are concatenated on device and fetched in one transfer, after the
    newest call is already queued, so the device never waits for the host. Calls that ran
    inline bring their metrics as host arrays already (``packed`` is NumPy): those are joined on
    the host (a jitted concatenation of many small rows costs more than NumPy's). Each read
    also closes a timing window (see ``StepTimer``).
    """

    def __init__(self, programs: CompiledSteps, timer: StepTimer, log_every: int):
        self.programs = programs  # its metric names are known once a program is compiled
        self.timer = timer
        self.log_every = log_every
        self.pending: list[PendingCall] = []
        self.log_due = False  # a pending call includes a step to log

    def add(self, call: PendingCall) -> None:
        self.pending.append(call)
        end = call.first_step + call.steps
        self.log_due |= end // self.log_every > call.first_step // self.log_every

    def due(self) -> bool:
        return self.log_due or len(self.pending) >= MAX_PENDING_CALLS

    def calls_to_read(self, step: int, k: int) -> int:
        """Calls of ``k`` steps from ``step`` until the boundary that reads: the one after the
        call that passes the next log step (one call late), or after the pending limit."""
        if self.due():
            return 1
        next_log = (step // self.log_every + 1) * self.log_every
        return min(-(-(next_log - step) // k) + 1, MAX_PENDING_CALLS - len(self.pending))

    def read(self) -> Table | None:
        """Block on the pending calls and return the metrics of their steps."""
        if not self.pending:
            return None
        calls, self.pending, self.log_due = self.pending, [], False
        packed = [c.packed for c in calls]
        if len(packed) == 1 or isinstance(packed[0], np.ndarray):  # no program to dispatch
            values = (np.stack(packed) if packed[0].ndim == 1 else np.concatenate(packed))
        else:
            values = np.asarray(_stack(packed))
        last = calls[-1].first_step + calls[-1].steps
        self.timer.record(last, calls, any(c.during_save for c in calls))
        names = self.programs.metric_names
        return Table(calls[0].first_step + 1, names, values.reshape(-1, len(names)))
