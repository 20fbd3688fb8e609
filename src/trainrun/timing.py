"""How trainrun measures: compile apart from steps, steady state after warmup, device time seen
through blocking reads, and the provenance that says what the numbers were measured on."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from importlib import metadata
from typing import Any

import jax


def provenance(config_digest: str) -> dict[str, Any]:
    """What a figure was measured on; written to ``provenance.json`` and the summary."""
    devices = jax.devices()
    return {
        "trainrun": metadata.version("trainrun"),
        "jax": jax.__version__,
        "jaxlib": metadata.version("jaxlib"),
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "config_digest": config_digest,
    }


@dataclasses.dataclass
class StepTimer:
    """Device time per step, from blocking reads at the end of windows of calls.

    The loop reads a window of calls' outputs (``block_until_ready``) only after the next call
    is queued, so the device never idles for the host. A window occupied the device from
    ``max(its first dispatch, the previous window's end)`` to its end; that span over its step
    count is the time per step. The first ``warmup_windows`` windows are excluded (allocation,
    caches, thread start-up).
    """

    warmup_windows: int = 1
    _last_done: float | None = None
    per_step_s: list[float] = dataclasses.field(default_factory=list)

    def record(self, dispatched_at: float, steps: int) -> None:
        """Call right after the window's outputs are known to be ready."""
        done = time.perf_counter()
        start = dispatched_at if self._last_done is None else max(dispatched_at, self._last_done)
        self._last_done = done
        self.per_step_s.append((done - start) / steps)

    def steady(self) -> list[float]:
        """Per-step times of the windows after warmup (all windows if the run had no more)."""
        return self.per_step_s[self.warmup_windows:] or self.per_step_s

    def median_step_s(self) -> float | None:
        steady = self.steady()
        return statistics.median(steady) if steady else None


class Stopwatch:
    """Accumulates wall time per named phase (compile, data, checkpoint, eval, ...)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)


class _Phase:
    def __init__(self, watch: Stopwatch, name: str):
        self.watch, self.name = watch, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        self.watch.totals[self.name] = self.watch.totals.get(self.name, 0.0) + elapsed
