"""How trainrun measures: compile apart from steps, steady state after warmup, step compute seen
through blocking reads, the parts of a step made on the host before its update (a
reinforcement-learning run's rollouts), the wall time by phase. ``training/summary.py`` puts
them together."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any


@dataclasses.dataclass
class Window:
    """One read of the calls' metrics: ``steps`` steps up to ``last_step``, whose step compute
    took ``compute_s``. during_save: a checkpoint was being written in the background while
    they ran (its write competes with the steps for the CPU). first_run_steps, first_run_s:
    the window's calls that were their program's first run (inline), kept out of ``steps``."""

    last_step: int
    steps: int
    compute_s: float
    during_save: bool = False
    first_run_steps: int = 0
    first_run_s: float = 0.0

    @property
    def per_step_s(self) -> float:
        return self.compute_s / self.steps if self.steps else 0.0


@dataclasses.dataclass(frozen=True)
class TimedBatch:
    """One batch made on the host: drawn after ``step`` steps, from ``started`` to ``ended``
    (``time.perf_counter``), ``seconds`` in each of its parts."""

    step: int
    started: float
    ended: float
    seconds: dict[str, float]


class PartClock:
    """The parts of one batch as it is made: ``mark(part)`` ends the part begun at the last
    mark (or at the start); a part marked twice adds up."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def mark(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] = self.seconds.get(part, 0.0) + now - self.last
        self.last = now


@dataclasses.dataclass
class HostParts:
    """The parts of a step made on the host before its update, a batch at a time: a
    reinforcement-learning run's generation, reference pass and scoring. A batch serves
    ``steps_per_batch`` steps. The first batch is warm-up (its programs compile as it is
    drawn): the per-step figures leave it out when there are others."""

    steps_per_batch: int = 1
    batches: list[TimedBatch] = dataclasses.field(default_factory=list)

    def add(self, step: int, clock: PartClock) -> None:
        """The batch drawn after ``step`` steps, timed by ``clock``, done now."""
        self.batches.append(TimedBatch(step, clock.started, time.perf_counter(),
                                       dict(clock.seconds)))

    def steady(self) -> list[TimedBatch]:
        """The batches after the warm-up one (all of them if there is no other)."""
        return self.batches[1:] or self.batches

    def median_per_step(self) -> dict[str, float]:
        """Each part's median seconds per step (``{}``: no batch was drawn)."""
        steady = self.steady()
        names = dict.fromkeys(name for batch in steady for name in batch.seconds)
        return {name: statistics.median(b.seconds.get(name, 0.0) for b in steady)
                / self.steps_per_batch for name in names}

    def totals(self) -> dict[str, float]:
        """Each part's seconds over every batch (warm-up included): wall time."""
        totals: dict[str, float] = {}
        for batch in self.batches:
            for name, seconds in batch.seconds.items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    def per_step_s(self, first: int, last: int) -> float:
        """Seconds per step of the batches that serve steps ``first..last`` (warm-up left
        out where another is there); 0 when none."""
        served = [b for b in self.steady() if first - self.steps_per_batch <= b.step < last]
        if not served:
            return 0.0
        return (sum(sum(b.seconds.values()) for b in served)
                / (len(served) * self.steps_per_batch))

    def within(self, start: float, end: float) -> float:
        """The batches' seconds between ``start`` and ``end`` (``time.perf_counter``)."""
        return sum(max(min(b.ended, end) - max(b.started, start), 0.0) for b in self.batches)


@dataclasses.dataclass
class StepTimer:
    """Step compute time, a window of calls at a time (each window ended by a blocking read).

    inline: each call runs in the calling thread (one CPU device, ``process.calls_run_inline``):
        a window's compute is the sum of its calls' own durations, so the host's work between
        calls (batches, hooks, logging) is not in it. The loop waits for each call's metrics
        before it takes the time: XLA:CPU returned from some long calls (a scan of 30 steps
        of the default MLP) before they were done, so the return alone undercounts a call.
    otherwise (asynchronous calls): a window occupied the device from ``max(its first
        dispatch, the previous window's end)`` to the end of its read. The loop reads only after
        the next call is queued, so the device never idles for the host.

    The first ``warmup_windows`` windows are left out of the statistics (allocation, caches,
    thread start-up), and so are windows that ran while a checkpoint was written in the
    background: what they lost to it is measured (``background_slowdown_s``) and reported as
    its own part of the wall time. Inline, each program's first call is kept out of the windows
    too (``first_calls_s``): it takes far longer than the next (the runtime's first execution
    of a new program), which alone put the first log line's steps/s far below the others'
    (BENCHMARKS.md, "The default checkpoint policy on the default MLP").

    host: the parts of each step made on the host before its update (``HostParts``); with
    asynchronous calls the batches drawn inside a window are taken out of its compute, which
    is then the updates' alone, as inline.
    """

    inline: bool = False
    warmup_windows: int = 1
    windows: list[Window] = dataclasses.field(default_factory=list)
    first_calls_s: float = 0.0
    first_calls: list[Window] = dataclasses.field(default_factory=list)  # a run of one call
    host: HostParts | None = None
    _last_done: float | None = None

    def record(self, last_step: int, calls: list[Any], during_save: bool = False) -> Window:
        """Call right after the window's outputs are known to be ready; ``calls`` have
        ``dispatched_at``, ``returned_at`` and ``steps``."""
        done = time.perf_counter()
        steps = sum(c.steps for c in calls)
        first_steps, first_s = 0, 0.0
        if self.inline:
            compute = 0.0
            for c in calls:
                if c.first_run:
                    first_steps += c.steps
                    first_s += c.returned_at - c.dispatched_at
                    self.first_calls.append(Window(c.first_step + c.steps, c.steps,
                                                   c.returned_at - c.dispatched_at))
                else:
                    compute += c.returned_at - c.dispatched_at
            self.first_calls_s += first_s
            steps -= first_steps
        else:
            first = calls[0].dispatched_at
            start = first if self._last_done is None else max(first, self._last_done)
            compute = done - start
            if self.host is not None:  # the host drew batches for the later calls meanwhile
                compute = max(compute - self.host.within(start, done), 0.0)
        self._last_done = done
        window = Window(last_step, steps, compute, during_save, first_steps, first_s)
        self.windows.append(window)
        return window

    def timed(self) -> list[Window]:
        """Windows with steps timed; a run whose every call was a program's first has only
        those calls (``only_first_runs``)."""
        if self.only_first_runs():
            return self.first_calls
        return [w for w in self.windows if w.steps]

    def only_first_runs(self) -> bool:
        """Every timed step was in a program's first run (a short run): its one-time set-up is
        in the step time."""
        return bool(self.first_calls) and not any(w.steps for w in self.windows)

    def steady(self) -> list[Window]:
        """Timed windows after warmup (all of them if the run had no more)."""
        timed = self.timed()
        return timed[self.warmup_windows:] or timed

    def warmup_count(self) -> int:
        """Timed windows left out as warmup."""
        return len(self.timed()) - len(self.steady())

    def clean(self) -> list[Window]:
        """Steady windows without a background save (all steady ones if none is clean)."""
        steady = self.steady()
        return [w for w in steady if not w.during_save] or steady

    def median_step_s(self) -> float | None:
        clean = self.clean()
        return statistics.median(w.per_step_s for w in clean) if clean else None

    def compute_s(self) -> float:
        return sum(w.compute_s for w in self.windows)

    def background_slowdown_s(self) -> float:
        """What the windows run during a background save took beyond the clean median step
        time: the steps' own slowdown from the save, measured."""
        median = self.median_step_s()
        if median is None or not any(not w.during_save for w in self.steady()):
            return 0.0
        return sum(max(w.compute_s - w.steps * median, 0.0) for w in self.windows
                   if w.during_save)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """A run's wall-time split (``watch``), its step windows (``timer``) and the parts of its
    steps made on the host (``parts``: None where batches are only read)."""

    watch: Stopwatch
    timer: StepTimer
    parts: HostParts | None = None
