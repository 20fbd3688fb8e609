"""Metrics that leave the device while a fused K-step call is still running.

With ``steps_per_call`` K > 1 the loop otherwise sees a call's K rows of metrics only when the
whole call is done. ``metrics.stream: true`` adds an ordered ``io_callback`` after each step
inside the scan: the host receives step ``s``'s metrics as soon as step ``s`` is computed, in
step order (ordered effects run in program order), each exactly once.

The step stays pure: the host function is passed in. On XLA:CPU a program that calls back to
the host runs in the dispatching thread, so rows arrive during the call but the call no longer
overlaps the host's next dispatch; on GPU and TPU the call stays asynchronous and rows arrive
from the runtime's thread. ``benchmarks/streaming.py`` measures the cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from trainrun.reporting.run_output import RunOutput
from trainrun.reporting.table import Table

StepFn = Callable[[Any, Any], tuple[Any, dict[str, jax.Array]]]
Emit = Callable[[Table], None]


def streamed(step: StepFn, emit: Emit) -> StepFn:
    """``step`` that also sends each step's metrics to ``emit`` on the host, as a one-row
    ``Table`` (the new step number, the float32 row).

    The metrics travel as one float32 row (names sorted), as the loop's reads pack them: one
    host transfer per step instead of one per metric, and the
    values are the very ones the unstreamed run writes.
    """

    def streamed_step(state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        state, metrics = step(state, batch)
        names = sorted(metrics)
        row = jnp.stack([jnp.asarray(metrics[name], jnp.float32) for name in names])

        def to_host(step_number: np.ndarray, values: np.ndarray) -> None:
            emit(Table(int(step_number), names, values.reshape(1, -1)))

        io_callback(to_host, None, state.step, row, ordered=True)
        return state, metrics

    return streamed_step


class MetricStream:
    """The host end: each arriving row goes straight to the run's writers and console.

    output: the run's writers; a run compiles its step (with this stream in it) before its
    files exist, and gives the stream its writers once they do, before the first call."""

    def __init__(self, output: RunOutput | None = None):
        self.output = output
        self.last_step: int | None = None
        self.received = 0

    def __call__(self, row: Table) -> None:
        self.last_step = row.first
        self.received += 1
        assert self.output is not None, "a row arrived before the run's writers were given"
        self.output.write_table(row)  # the very text the loop's reads write
