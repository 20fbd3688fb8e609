"""A run's summary: what ``run()`` returns and ``summary.json`` holds, typed.

Step time is step compute (``timing.StepTimer``), and in a run whose batches are made on the
host from the params (a reinforcement-learning run's rollouts) those parts too: the whole
step, with each part's median per step in ``step_parts_s`` (``generation``, ``reference``,
``scoring``, ``update``); throughput counts whole steps. Where the rest of the wall time went
is the split, whose parts add up to the wall time:

    backend_start (JAX's runtime starting: a TPU's takes seconds; with several processes,
    their joining too), init, compile, first_calls (each program's first run, inline),
    data_wait, checkpoint (blocking), checkpoint_background (the steps' own slowdown while a
    save was written, measured), eval, logging, profiling, callbacks, step_compute, other
    (set-up, the loop's own bookkeeping, the summary); a run with host parts has each of them
    apart from data_wait
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from trainrun.reporting import mfu
from trainrun.reporting.timing import HostParts, StepTimer, Stopwatch
from trainrun.reporting.units import duration

if TYPE_CHECKING:
    from trainrun.config import RunConfig
    from trainrun.training.hooks import Boundary

# Stopwatch phase -> split name.
PHASES = {"backend": "backend_start", "init": "init", "compile": "compile", "data": "data_wait",
          "checkpoint": "checkpoint", "eval": "eval", "log": "logging", "profile": "profiling",
          "callbacks": "callbacks"}


def wall_split(watch: Stopwatch, timer: StepTimer, wall_s: float,
               parts: HostParts | None = None) -> dict[str, float]:
    """``wall_s`` split into parts that add up to it. Step compute overlapping a host phase
    (asynchronous calls run while the host logs) is counted once, in that phase. The parts of
    the steps made on the host (``parts``) are taken out of the data's time, each apart."""
    split = {name: watch.totals.get(phase, 0.0) for phase, name in PHASES.items()}
    if parts is not None:
        host = parts.totals()
        split["data_wait"] = max(split["data_wait"] - sum(host.values()), 0.0)
        split.update(host)
    split["first_calls"] = timer.first_calls_s
    split["checkpoint_background"] = timer.background_slowdown_s()
    compute = max(timer.compute_s() - split["checkpoint_background"], 0.0)
    split["step_compute"] = min(compute, max(wall_s - sum(split.values()), 0.0))
    split["other"] = max(wall_s - sum(split.values()), 0.0)
    return split


@dataclasses.dataclass
class RunSummary:
    """status: ``finished`` (also when a callback stopped the run: ``stopped_by`` says why) or
    ``preempted`` (stopped to be resumed, at ``preempted_at``)."""

    status: str = "finished"
    final_loss: float | None = None
    steps: int = 0  # the config's steps
    steps_done: int | None = None
    start_step: int | None = None  # where this process began (a resumed run: its checkpoint)
    steps_per_call: int | None = None
    compile_s: float = 0.0
    step_time_median_s: float | None = None
    step_parts_s: dict[str, float] = dataclasses.field(default_factory=dict)  # host parts
    timed_windows: int = 0
    warmup_windows: int = 0
    step_time_from_first_runs: bool = False  # every call was its program's first (short run)
    windows_during_save: int = 0
    steps_per_s: float | None = None
    examples_per_s: float | None = None
    batch_size: int | None = None
    wall_s: float = 0.0
    time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    wall_time_split_s: dict[str, float] = dataclasses.field(default_factory=dict)
    goodput: float | None = None
    flops_per_step: float | None = None
    flops_source: str | None = None
    flops_per_s: float | None = None
    mfu: float | None = None
    peak: dict[str, Any] | None = None
    mfu_note: str = ""
    stopped_by: str | None = None
    preempted_at: int | None = None
    checkpoint: str | None = None  # the last checkpoint saved
    best_checkpoint: dict[str, Any] | None = None  # {"step": s, "eval/loss": v} (keep_best)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> RunSummary:
        """A ``summary.json`` as written by this or an earlier trainrun (unknown keys dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names})

    def text(self) -> str:
        """The end-of-run summary as the console prints it."""
        p, split = self.provenance, self.wall_time_split_s
        step_s = self.step_time_median_s or 0.0
        parts = "  ".join(f"{name} {duration(s)}" for name, s in split.items() if s >= 0.005)
        per = "update" if self.step_parts_s else "step"  # the FLOPs counted: the update's
        flops = (f"{self.flops_per_step:,.0f} FLOPs/{per} ({self.flops_source})"
                 if self.flops_per_step else "")
        if self.mfu is not None and self.peak and self.flops_per_s:
            mfu_line = (f"{self.mfu:.2%} of {self.peak['flops_per_s'] / 1e9:,.1f} GFLOP/s "
                        f"({self.peak['source']}); {flops}, "
                        f"{self.flops_per_s / 1e9:,.2f} GFLOP/s achieved")
        else:
            mfu_line = f"not measured: {self.mfu_note}" + (f"; {flops}" if flops else "")
        skipped = (f", {self.windows_during_save} during a background save left out"
                   if self.windows_during_save else "")
        stopped = f" ({self.stopped_by})" if self.stopped_by else ""
        first = ("; first runs of the programs only, one-time set-up included"
                 if self.step_time_from_first_runs else "")
        measured = "step compute only"
        if self.step_parts_s:
            measured = "the whole step: " + ", ".join(
                f"{name} {duration(s)}" for name, s in self.step_parts_s.items())
        best = (f"\n  best         checkpoint {self.best_checkpoint['step']}: " + ", ".join(
            f"{k} {v:.6g}" for k, v in self.best_checkpoint.items() if k != "step")
                if self.best_checkpoint else "")
        return (
            f"done: {self.steps_done} steps{stopped}, final loss {self.final_loss:.8g}\n"
            f"  compile      {duration(self.compile_s)} (separate from step time)\n"
            f"  step time    {duration(step_s)} median over {self.timed_windows} windows "
            f"after {self.warmup_windows} warmup{skipped} ({measured}{first})\n"
            f"  throughput   {self.steps_per_s or 0:,.1f} steps/s, "
            f"{self.examples_per_s or 0:,.0f} examples/s\n"
            f"  MFU          {mfu_line}\n"
            f"  wall time    {duration(self.wall_s)}: {parts} (goodput {self.goodput or 0:.1%})"
            f"{best}\n"
            f"  provenance   trainrun {p['trainrun']}, jax {p['jax']}, jaxlib {p['jaxlib']}, "
            f"{p['backend']} ({p['device_kind']}) x{p['device_count']}, "
            f"{p['process_count']} process(es), Python {p['python']}, "
            f"XLA_FLAGS={p['xla_flags']!r}, config {p['config_digest']}")


def timing_fields(timer: StepTimer, watch: Stopwatch, batch_size: int,
                  wall_s: float, parts: HostParts | None = None) -> dict[str, Any]:
    """The summary's measured fields: step time (the update's, and with ``parts`` each host
    part's and their sum), throughput, the wall-time split, goodput."""
    update_s = step_s = timer.median_step_s()
    step_parts = parts.median_per_step() if parts is not None else {}
    if step_parts and update_s is not None:
        step_parts["update"] = update_s
        step_s = sum(step_parts.values())
    steps_per_s = 1.0 / step_s if step_s else None
    split = wall_split(watch, timer, wall_s, parts)
    productive = split["step_compute"] + sum(split.get(name, 0.0) for name in step_parts
                                             if name != "update")
    steady = timer.steady()
    return {
        "compile_s": watch.totals.get("compile", 0.0),
        "step_time_median_s": step_s,
        "step_parts_s": step_parts if update_s is not None else {},
        "timed_windows": len(timer.clean()),
        "warmup_windows": timer.warmup_count(),
        "step_time_from_first_runs": timer.only_first_runs(),
        "windows_during_save": sum(w.during_save for w in steady) if timer.clean() != steady
        else 0,
        "steps_per_s": steps_per_s,
        "examples_per_s": steps_per_s * batch_size if steps_per_s else None,
        "batch_size": batch_size,
        "wall_s": wall_s,
        "time_s": dict(watch.totals),
        "wall_time_split_s": split,
        "goodput": productive / wall_s if wall_s > 0 else None,
    }


def summarize(config: RunConfig, boundary: Boundary, wall_s: float, *,
              flops: tuple[float | None, str | None], timer: StepTimer, watch: Stopwatch,
              batch_size: int, start_step: int, final_metrics: dict[str, float],
              parts: HostParts | None = None,
              best_checkpoint: dict[str, Any] | None,
              provenance: dict[str, Any]) -> RunSummary:
    """The summary of a run that ended at ``boundary`` (finished, or stopped by a callback).
    flops: FLOPs per step and where the figure comes from (``CompiledSteps.flops_per_step``),
    MFU measured on the update's time; parts: the steps' parts made on the host."""
    peak, why = mfu.find_peak(jax.default_backend(), jax.devices()[0].device_kind,
                              jax.device_count(), config.precision.compute)
    measured = timing_fields(timer, watch, batch_size, wall_s, parts)
    return RunSummary(
        final_loss=final_metrics.get("loss"), steps=config.steps,
        steps_done=boundary.step, start_step=start_step,
        steps_per_call=config.steps_per_call, stopped_by=boundary.stop_reason,
        checkpoint=str(boundary.saved) if boundary.saved is not None else None,
        best_checkpoint=best_checkpoint, provenance=provenance, **measured,
        **mfu.utilization(flops[0], measured["step_parts_s"].get(
            "update", measured["step_time_median_s"]), peak, why, flops[1]))
