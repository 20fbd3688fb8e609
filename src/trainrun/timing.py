"""How trainrun measures: compile apart from steps, steady state after warmup, device time seen
through blocking reads, and the provenance that says what the numbers were measured on."""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from importlib import metadata
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from trainrun.config import RunConfig


def package_version(name: str) -> str:
    """An installed package's version, or "unknown" where it has no metadata (trainrun run from
    a source checkout on ``PYTHONPATH``)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def provenance(config_digest: str) -> dict[str, Any]:
    """What a figure was measured on; written to ``provenance.json`` and the summary."""
    devices = jax.devices()
    return {
        "trainrun": package_version("trainrun"),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib"),
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
    """Accumulates wall time per named phase (compile, data, checkpoint, eval, ...).

    ``start_loop``/``end_loop`` mark the training loop: phases timed inside it are also kept
    apart (``in_loop``) so that what remains of the loop's time is the steps themselves (see
    ``wall_split``).
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.in_loop: dict[str, float] = {}
        self.loop_s = 0.0
        self._loop_start = 0.0
        self._looping = False

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def add(self, name: str, seconds: float) -> None:
        """Time measured by the caller (hot paths that avoid a context manager per step)."""
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        if self._looping:
            self.in_loop[name] = self.in_loop.get(name, 0.0) + seconds

    def start_loop(self) -> None:
        self._loop_start = time.perf_counter()
        self._looping = True

    def end_loop(self) -> None:
        if self._looping:
            self._looping = False
            self.loop_s += time.perf_counter() - self._loop_start


class _Phase:
    def __init__(self, watch: Stopwatch, name: str):
        self.watch, self.name = watch, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.watch.add(self.name, time.perf_counter() - self.start)


# Where a run's wall time went: Stopwatch phase -> summary name. Step compute is what is left of
# the training loop once its other phases are taken out: dispatching the jitted calls and
# waiting for their results.
PHASES = {"init": "init", "compile": "compile", "data": "data_wait", "checkpoint": "checkpoint",
          "eval": "eval", "log": "logging", "profile": "profiling"}


def wall_split(watch: Stopwatch, wall_s: float) -> dict[str, float]:
    """``wall_s`` split into parts that add up to it: the timed phases, ``step_compute`` and
    ``other`` (set-up before the loop, the summary, phases with names not listed)."""
    split = {name: watch.totals.get(phase, 0.0) for phase, name in PHASES.items()}
    inside = sum(watch.in_loop.values())
    split["step_compute"] = max(watch.loop_s - inside, 0.0)
    split["other"] = max(wall_s - sum(split.values()), 0.0)
    return split


def goodput(split: dict[str, float], wall_s: float) -> float | None:
    """The fraction of the run's wall time spent computing steps."""
    return split["step_compute"] / wall_s if wall_s > 0 else None


def run_summary(config: RunConfig, last: dict[str, float], timer: StepTimer, watch: Stopwatch,
             prov: dict[str, Any], batch_size: int, wall_s: float) -> dict[str, Any]:
    """``summary.json``: the run's figures (steady-state step time, throughput, the wall-time
    split and goodput) with their provenance. MFU is added by the caller."""
    step_s = timer.median_step_s()
    steps_per_s = 1.0 / step_s if step_s else None
    split = wall_split(watch, wall_s)
    return {
        "final_loss": last.get("loss"),
        "steps": config.steps,
        "steps_per_call": config.steps_per_call,
        "compile_s": watch.totals.get("compile", 0.0),
        "step_time_median_s": step_s,
        "timed_windows": len(timer.steady()),
        "warmup_windows": len(timer.per_step_s) - len(timer.steady()),
        "steps_per_s": steps_per_s,
        "examples_per_s": steps_per_s * batch_size if steps_per_s else None,
        "batch_size": batch_size,
        "wall_s": wall_s,
        "time_s": dict(watch.totals),
        "wall_time_split_s": split,
        "goodput": goodput(split, wall_s),
        "provenance": prov,
    }


def summary_text(s: dict[str, Any]) -> str:
    """The end-of-run summary as the console prints it."""
    p = s["provenance"]
    step_s = s["step_time_median_s"]
    split = "  ".join(f"{name} {seconds:.2f}" for name, seconds in s["wall_time_split_s"].items()
                      if seconds >= 0.005)
    flops = (f"{s['flops_per_step']:,.0f} FLOPs/step ({s.get('flops_source')})"
             if s.get("flops_per_step") else "")
    if s.get("mfu") is not None:
        mfu_line = (f"{s['mfu']:.2%} of {s['peak']['flops_per_s'] / 1e9:,.1f} GFLOP/s "
                    f"({s['peak']['source']}); {flops}, "
                    f"{s['flops_per_s'] / 1e9:,.2f} GFLOP/s achieved")
    else:
        mfu_line = f"not measured: {s.get('mfu_note')}" + (f"; {flops}" if flops else "")
    return (
        f"done: {s['steps']} steps, final loss {s['final_loss']:.8g}\n"
        f"  compile      {s['compile_s']:.3f} s (separate from step time)\n"
        f"  step time    {step_s * 1e6:,.1f} µs median over {s['timed_windows']} windows after "
        f"{s['warmup_windows']} warmup (each ended by block_until_ready)\n"
        f"  throughput   {s['steps_per_s']:,.1f} steps/s, {s['examples_per_s']:,.0f} examples/s\n"
        f"  MFU          {mfu_line}\n"
        f"  wall time    {s['wall_s']:.2f} s: {split} (goodput {s['goodput']:.1%})\n"
        f"  provenance   trainrun {p['trainrun']}, jax {p['jax']}, jaxlib {p['jaxlib']}, "
        f"{p['backend']} ({p['device_kind']}) x{p['device_count']}, "
        f"{p['process_count']} process(es), Python {p['python']}, "
        f"XLA_FLAGS={p['xla_flags']!r}, config {p['config_digest']}")
