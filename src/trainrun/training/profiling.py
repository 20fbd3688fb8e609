"""``profile.steps: [a, b]``: a ``jax.profiler`` trace of steps a..b in ``<run dir>/profile``.

The trace starts before the call that runs step ``a`` and stops once the call that runs step
``b`` has finished (with K steps per call, whole calls are traced). It holds the XLA ops on each
device, host-side dispatch and the Python loop. To open it:

    tensorboard --logdir <run dir>/profile       (with tensorboard-plugin-profile installed)
    or load <run dir>/profile/plugins/profile/<time>/perfetto_trace.json.gz at ui.perfetto.dev
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from trainrun.training.hooks import Hook

PROFILE_DIR = "profile"


def how_to_open(trace_dir: Path) -> str:
    return (f"open it with `tensorboard --logdir {trace_dir}` (pip install "
            "tensorboard-plugin-profile), or load its perfetto_trace.json.gz at "
            "https://ui.perfetto.dev")


class ProfileWindow(Hook):
    """Starts and stops the trace around the calls that run steps ``first..last`` (a hook:
    ``before_call`` starts it, the boundary after step ``last`` stops it).

    say: where the message that the trace is written goes (the run's console)."""

    def __init__(self, steps: list[int], run_dir: Path, enabled: bool = True,
                 say: Callable[[str], None] = print, watch: Any = None):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.dir = run_dir / PROFILE_DIR
        self.enabled = enabled and bool(steps)
        self.active = False
        self.done = False
        self.say = say
        self.watch = watch

    every_boundary = False  # a boundary before step ``first`` and at ``last`` (steps_to_next)

    def steps_to_next(self, step: int) -> int | None:
        """Calls end before step ``first`` (the trace starts with it) and at ``last``."""
        if not self.enabled or self.done:
            return None
        if not self.active:
            return self.first - 1 - step if step < self.first - 1 else None
        return self.last - step if step < self.last else None

    def at_boundary(self, boundary: Any) -> None:
        if not self.active or boundary.step < self.last:
            return
        with self.watch.phase("profile"):
            boundary.sync()  # the traced steps have run
            message = self._stop()
        self.say(message)

    def before_call(self, done: int, k: int) -> None:
        """Before dispatching a call that runs steps ``done + 1 .. done + k``."""
        if (self.enabled and not self.active and not self.done and done + k >= self.first
                and done < self.last):
            self.dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True

    def _stop(self) -> str:
        jax.profiler.stop_trace()
        self.active, self.done = False, True
        return f"profile of steps {self.first}-{self.last} written to {self.dir}; " + \
            how_to_open(self.dir)

    def close(self) -> None:
        """Stop a trace still running (the run ended or failed inside the window)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
