"""Metrics that leave the device while a fused K-step call is still running.

With ``steps_per_call`` K > 1 the loop otherwise sees a call's K rows of metrics only when the
whole call is done. ``metrics.stream: true`` adds an ordered ``io_callback`` after each step
inside the scan: the host receives step ``s``'s metrics as soon as step ``s`` is computed, in
step order (ordered effects run in program order), each exactly once.

The step stays pure: the host function is passed in (``reporting/stream.py`` is the run's). On
XLA:CPU a program that calls back to the host runs in the dispatching thread, so rows arrive
during the call but the call no longer overlaps the host's next dispatch; on GPU and TPU the
call stays asynchronous and rows arrive from the runtime's thread. ``benchmarks/streaming.py``
measures the cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

StepFn = Callable[[Any, Any], tuple[Any, dict[str, jax.Array]]]
# (the new step number, the metric names, their float32 values as one row [1, n])
Emit = Callable[[int, list[str], np.ndarray], None]


def streamed(step: StepFn, emit: Emit) -> StepFn:
    """``step`` that also sends each step's metrics to ``emit`` on the host: the new step
    number, the names and the float32 row.

    The metrics travel as one float32 row (names sorted), as the loop's reads pack them: one
    host transfer per step instead of one per metric, and the
    values are the very ones the unstreamed run writes.
    """

    def streamed_step(state: Any, batch: Any) -> tuple[Any, dict[str, jax.Array]]:
        state, metrics = step(state, batch)
        names = sorted(metrics)
        row = jnp.stack([jnp.asarray(metrics[name], jnp.float32) for name in names])

        def to_host(step_number: np.ndarray, values: np.ndarray) -> None:
            emit(int(step_number), names, values.reshape(1, -1))

        io_callback(to_host, None, state.step, row, ordered=True)
        return state, metrics

    return streamed_step
