"""When a run saves: every ``checkpoint.every`` steps or every ``checkpoint.every_seconds``,
whichever comes first, and always at the end and when the run stops (a preemption, a callback).

Each Orbax save blocks the loop while the state is copied out, and its background write then
competes with the steps for the CPU: on the default MLP a save costs as much as many hundreds of
its steps, so ``every: 100`` spent most of a run saving (BENCHMARKS.md, "The default checkpoint
policy on the default MLP"). The default is therefore by time (``every_seconds: 300``), steps
off: a small model saves only at its end, a large one every five minutes. Step-based points
stay for what must land on exact steps (``trainrun verify-resume``'s kill points).

A step-based checkpoint cuts the call that would pass it (``steps_to_next``), so the state saved
is the state at that step. A time-based one is taken at the first boundary after the interval;
with several processes, process 0's clock decides and the others follow, so every host saves
the same step (asked at the first boundary past each ``metrics.every`` steps: one broadcast there
instead of one every call). ``checkpoint.keep_best: eval/<metric>`` also saves at every
evaluation, with that metric, and Orbax keeps the best of those beside the latest ``keep``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

Clock = Callable[[], float]  # monotonic seconds (``trainrun.run``'s ``clock``)


class CheckpointPolicy:
    """every: steps between checkpoints (0: none by steps). every_seconds: seconds between
    them (0: none by time), counted from the run's start and from each save. clock: seconds,
    monotonic. check_every: with several processes, the time is looked at once per this many
    steps."""

    def __init__(self, every: int, every_seconds: float, clock: Clock = time.monotonic,
                 check_every: int = 1):
        self.every = every
        self.every_seconds = every_seconds
        self.clock = clock
        self.last_save = self.clock()
        self.shared = jax.process_count() > 1  # hosts must agree on a time-based step
        self.check_every = check_every
        self.checked = 0

    def steps_to_next(self, step: int) -> int | None:
        return self.every - step % self.every if self.every else None

    def due(self, step: int) -> bool:
        """Whether the boundary at ``step`` saves (the run's end and stops are the hook's)."""
        if self.every and step % self.every == 0:
            return True
        if not self.poll(step):
            return False
        if self.shared:  # every host passes the same boundaries: they all ask here
            self.checked = step
            return bool(multihost_utils.broadcast_one_to_all(np.bool_(self._late())))
        return True

    def poll(self, step: int) -> bool:
        """Whether the boundary at ``step`` must ask ``due`` for the time: past the interval
        (one process), or at the next look at the time (several: the same steps on all)."""
        if not self.every_seconds:
            return False
        if self.shared:
            return step // self.check_every != self.checked // self.check_every
        return self._late()

    def _late(self) -> bool:
        return self.clock() - self.last_save >= self.every_seconds

    def saved(self) -> None:
        self.last_save = self.clock()
