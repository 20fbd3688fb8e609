"""The jitted step programs of a run and the reading of their metrics: what one call of K steps
takes (the state, donated, and K stacked host batches) and gives back (the new state and one
float32 array of every step's metrics), and how the loop reads those arrays a window at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.models import Model
from trainrun.program.optim import Optimizer
from trainrun.program.packing import packing_for
from trainrun.program.precision import Policy
from trainrun.program.resident import ResidentBatches
from trainrun.program.state import TrainState
from trainrun.program.step import make_multi_step, make_train_step
from trainrun.reporting import mfu
from trainrun.reporting.stream import MetricStream, streamed
from trainrun.reporting.table import Table
from trainrun.reporting.timing import StepTimer, Stopwatch

Batch = Any
MAX_PENDING_CALLS = 256  # bounds how stale unread metrics get between log points


def pack_metrics(metrics: dict[str, jax.Array]) -> jax.Array:
    """Scalar metrics -> one float32 array ``[..., n]`` (names sorted): one transfer per call
    instead of one per metric. Counts stay exact below 2**24."""
    return jnp.stack([jnp.asarray(metrics[name], jnp.float32) for name in sorted(metrics)],
                     axis=-1)


class CompiledSteps:
    """The jitted step programs of a run: one for K steps per call, one more for a shorter tail
    call (each compiled once). Compiled ahead of time so compile time is its own figure; the
    jitted call then finds that executable in JAX's cache and keeps its fast dispatch path.

    The calls take and return the state as ``carried``: the ``TrainState`` itself, or, for a
    small state on one device, its flat buffers (``packing.py``). ``carry`` and ``state``
    convert; the loop converts back only where it needs the state (checkpoints, eval)."""

    def __init__(self, model: Model, optimizer: Optimizer, steps_per_call: int,
                 watch: Stopwatch, *, abstract: TrainState | None = None,
                 accumulate: int = 1, policy: Policy | None = None,
                 state_sharding: TrainState | None = None,
                 batch_sharding: jax.sharding.Sharding | None = None,
                 stream: MetricStream | None = None, resident: ResidentBatches | None = None):
        single = make_train_step(model, optimizer, accumulate=accumulate, policy=policy,
                                 scanned=steps_per_call > 1)
        self.one_step = single  # what one step computes (FLOPs per step)
        if stream is not None:  # each step's metrics also leave mid-call (metrics.stream)
            single = streamed(single, stream)
        self.step = single if steps_per_call == 1 else make_multi_step(single)

        def one_row(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
            state, metrics = single(state, batch)
            return state, pack_metrics(metrics)

        # Each step's metrics packed inside the scan's body: the scan then writes one row a
        # step instead of one value per metric (the default MLP at K=100: 15.8 against 17.6 µs
        # a step, a scan output costing about 0.4 µs a step).
        step = one_row if steps_per_call == 1 else make_multi_step(one_row)
        self.resident = resident
        if resident is not None:  # the calls take ``resident.args``: batches cut on the device
            step = _cut_on_device(one_row, resident, steps_per_call > 1)
        self.abstract = abstract
        # Without the abstract state (a caller holding TrainStates) the calls take TrainStates.
        self.packing = packing = (packing_for(abstract, jax.device_count())
                                  if abstract is not None else None)

        def packed_step(carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
            state = packing.unpack(carried) if packing else carried
            state, rows = step(state, batch)
            return packing.pack(state) if packing else state, rows

        if packing is not None:
            self._carry, self._state = jax.jit(packing.pack), jax.jit(packing.unpack)
        if packing is not None or state_sharding is None:  # one device: nothing to pin
            self.fn = jax.jit(packed_step, donate_argnums=0)
        else:  # pinned, so the donated state comes back exactly where it went in
            metrics_sharding = jax.sharding.NamedSharding(batch_sharding.mesh,
                                                          jax.sharding.PartitionSpec())
            # resident arrays: on the run's one device, as the replicated sharding says
            inputs = metrics_sharding if resident is not None else batch_sharding
            self.fn = jax.jit(packed_step, donate_argnums=0,
                              in_shardings=(state_sharding, inputs),
                              out_shardings=(state_sharding, metrics_sharding))
        self.watch = watch
        self.programs: dict[int, Any] = {}
        self.metric_names: list[str] = []

    def carry(self, state: TrainState) -> Any:
        """``state`` as the calls take it."""
        return self._carry(state) if self.packing else state

    def state(self, carried: Any) -> TrainState:
        """The ``TrainState`` in ``carried`` (new arrays when packed: the next call may donate
        ``carried`` while they are still in use)."""
        return self._state(carried) if self.packing else carried

    def compile(self, k: int, carried: Any, batch: Batch) -> None:
        """Compile the program for calls of ``k`` steps (before its call is timed)."""
        if not self.metric_names:
            state = self.abstract if self.abstract is not None else carried
            step, example = ((self.one_step, self.resident.example(1)) if self.resident
                             else (self.step, batch))
            self.metric_names = sorted(jax.eval_shape(step, state, example)[1])
        with self.watch.phase("compile"):
            self.programs[k] = self.fn.lower(carried, batch).compile()

    def flops_per_step(self, abstract: TrainState, example: Batch,
                       resident: ResidentBatches | None, counted: Any,
                       batch_size: int) -> tuple[float | None, str | None]:
        """FLOPs of one step and their source (``mfu.flops_per_step``). A program that gathers
        its own batches (``resident.py``) would count the gather too, so then the step alone
        is lowered on a batch's shapes."""
        compiled, batch = ((self.programs, example) if resident is None
                           else ({}, resident.example(2)))
        return mfu.flops_per_step(compiled, self.one_step, abstract, batch, counted, batch_size)

    def __call__(self, k: int, carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        if k not in self.programs:
            self.compile(k, carried, batch)
        return self.fn(carried, batch)


def _cut_on_device(one_row: Any, resident: ResidentBatches, scanned: bool) -> Any:
    """``one_row`` on batches gathered from ``resident``'s arrays by the step counter: a call
    ``(state, resident.args(...)) -> (state, rows)`` of one step, or of as many as the args'
    length vector under a scan, each step cutting its own batch (``ResidentBatches``)."""

    def call(state: TrainState, args: Any) -> tuple[TrainState, jax.Array]:
        def step(state: TrainState, _: Any) -> tuple[TrainState, jax.Array]:
            return one_row(state, resident.batch(state.step, args))

        k = args[1].shape[0]
        if not scanned:
            return step(state, None)
        if k == 1:  # a one-step tail: as XLA computes the host path's scan of one (it drops
            state, row = step(state, None)  # the loop), not as a scan of one buffer
            return state, row[None]
        return jax.lax.scan(step, state, None, length=k)

    return call


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
    the host (a jitted concatenation of 100 one-step rows took 130-230 µs a read). Each read
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
