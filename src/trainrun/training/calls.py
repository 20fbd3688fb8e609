"""One jitted call of the loop: the next ``k`` steps' batches placed, the program compiled on
its first run (compile time stays out of step time), the state donated, the call recorded for
the metrics reader."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from trainrun.program.compiled import CompiledSteps
from trainrun.program.sharding import BatchPlacement
from trainrun.reporting.timing import Timing
from trainrun.training.metrics_reader import PendingCall

# Calls queued on the devices when dispatch is asynchronous: enough to keep a device fed;
# without a bound, simulated CPU devices deadlocked in XLA's collectives with calls dispatched
# back to back (docs/internals.md, "Calls in flight").
MAX_IN_FLIGHT = 2


class CallRunner:
    """Makes the run's calls, one at a time, in step order.

    programs: the run's compiled steps; batches, placement: its host batches and where a
    batch goes on the mesh (``stacked``: ``[k, ...]``, calls of K > 1 steps). saving: whether a
    checkpoint is being written; reset_rate: the console's rate restarts at a step (after a
    compile); follow: told the carried state a call starts from before its batches are taken
    (batches drawn from the current params: a reinforcement-learning run's rollouts)."""

    def __init__(self, programs: CompiledSteps, batches: Any, placement: BatchPlacement,
                 timing: Timing, *, stacked: bool, saving: Callable[[], bool],
                 reset_rate: Callable[[int], None],
                 follow: Callable[[Any], None] | None = None):
        self.programs = programs
        self.batches = batches
        self.placement = placement
        self.watch = timing.watch
        self.inline = timing.timer.inline
        self.saving = saving
        self.reset_rate = reset_rate
        self.in_flight: collections.deque[jax.Array] = collections.deque()
        self.example: Any = None  # what the last call took: a host batch's shapes count FLOPs
        self.ran: set[int] = set()  # the call sizes whose program has run once
        # the batch source's take, looked up once: nothing is resolved per call
        self.take = programs.source.take
        self.stacked = stacked
        self.follow = follow

    def next_batch(self, k: int, carried: Any = None) -> Any:
        """What the call of the next ``k`` steps takes, from the programs' batch source
        (``program/batch_source.py``: the next host batches placed on the mesh, stacked
        ``[k, ...]`` when calls run K > 1, unless another source holds them). Its time is the
        run's data time. carried: the state the call starts from, for ``follow``."""
        start = time.perf_counter()
        if self.follow is not None:
            self.follow(carried)
        self.example = batch = self.take(self.batches, k, self.placement, self.stacked)
        self.watch.add("data", time.perf_counter() - start)
        return batch

    def call(self, step: int, k: int, carried: Any, batch: Any) -> tuple[Any, PendingCall]:
        """The call of steps ``step + 1 .. step + k`` on ``carried`` (donated) and ``batch``
        (``next_batch``): the new carried state and the call's pending metrics."""
        programs, clock = self.programs, time.perf_counter
        dispatched = clock()
        saving = self.saving()  # the call's time then overlaps a save's writing
        first_run = k not in self.ran
        if first_run:  # set-up may have compiled it already (its memory checked)
            if k not in programs.programs:
                programs.compile(k, carried, batch)
            self.ran.add(k)
            self.reset_rate(step)
            dispatched = clock()
        carried, packed = programs(k, carried, batch)
        rows: jax.Array | np.ndarray = packed
        if self.inline:  # the call's end, its metrics read: XLA:CPU may still finish a
            rows = np.asarray(packed)  # long call on its threads after returning
        else:
            self.bound_in_flight(packed)
        return carried, PendingCall(step, k, rows, dispatched, clock(), saving, first_run)

    def bound_in_flight(self, packed: jax.Array) -> None:
        """At most ``MAX_IN_FLIGHT`` calls queued: the host waits for the oldest."""
        self.in_flight.append(packed)
        if len(self.in_flight) > MAX_IN_FLIGHT:
            self.in_flight.popleft().block_until_ready()
