"""When a run saves: by steps or by time, whichever comes first (time from a fake clock, not a
sleep), always at the end; the default saves a small run only at its end. And how the step time
leaves out what a background save costs the steps around it."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

import trainrun
from trainrun import rundir
from trainrun.config import load_config
from trainrun.data import batch_iterator, build_dataset
from trainrun.reporting.timing import StepTimer


class FakeClock(trainrun.Callback):
    """The run's clock, moved forward at the boundaries ``jumps`` names."""

    def __init__(self, jumps: dict[int, float]):
        self.jumps, self.now = jumps, 0.0

    def __call__(self) -> float:
        return self.now

    def at_boundary(self, boundary: trainrun.Boundary) -> None:
        self.now = self.jumps.get(boundary.step, self.now)


def saved_steps(tmp_path, jumps: dict[int, float], *overrides: str) -> list[int]:
    clock = FakeClock(jumps)
    config = load_config("mlp", ["steps=100", "metrics.every=10", "checkpoint.keep=10", *overrides])
    trainrun.run(config, tmp_path, out=io.StringIO(), callbacks=[clock], clock=clock)
    return rundir.committed_steps(tmp_path / "checkpoints")


def test_a_checkpoint_is_saved_at_the_first_boundary_after_every_seconds(tmp_path):
    # 301 s at step 30: due. 450 s at step 40: only 149 s after that save. 700 s at step 70: due.
    jumps = {30: 301.0, 40: 450.0, 70: 700.0}
    assert saved_steps(tmp_path, jumps, "checkpoint.every_seconds=300") == [30, 70, 100]


def test_steps_or_seconds_whichever_comes_first(tmp_path):
    jumps = {10: 301.0, 50: 605.0}  # 50 is also a step checkpoint: one save there
    assert saved_steps(tmp_path, jumps, "checkpoint.every=40",
                       "checkpoint.every_seconds=300") == [10, 40, 50, 80, 100]


def test_the_time_is_looked_at_after_every_call_between_boundaries(tmp_path):
    # No callback asks for boundaries, so calls run back to back between the reads after log
    # steps (11, 21, ...); each call takes one batch and 10 s of a fake clock: the save lands
    # on step 30.
    config = load_config("mlp", ["steps=100", "metrics.every=10", "checkpoint.keep=10",
                                 "checkpoint.every_seconds=300"])
    taken = 0

    def batches():
        nonlocal taken
        for batch in batch_iterator(build_dataset(config.data, seed=config.seed)):
            taken += 1
            yield batch

    trainrun.run(config, tmp_path, out=io.StringIO(), data=batches(), clock=lambda: 10.0 * taken)
    assert rundir.committed_steps(tmp_path / "checkpoints") == [30, 60, 90, 100]


def test_the_default_policy_saves_a_short_run_at_its_end_only(tmp_path):
    config = load_config("mlp")
    assert (config.checkpoint.every, config.checkpoint.every_seconds) == (0, 300)
    assert saved_steps(tmp_path, {}, "steps=2000", "metrics.every=1000") == [2000]


def calls(*spans: tuple[float, float, int], first: bool = False) -> list[SimpleNamespace]:
    return [SimpleNamespace(dispatched_at=a, returned_at=b, steps=k, first_run=first,
                            first_step=0) for a, b, k in spans]


def test_windows_run_during_a_background_save_leave_the_step_time_and_are_measured():
    timer = StepTimer(inline=True, warmup_windows=1)
    timer.record(1, calls((0.0, 34.0, 1), first=True))  # a program's first run: kept apart
    timer.record(10, calls((0.0, 9.0, 10)))  # warmup
    for last in (20, 30, 40):  # clean: 1 s a step
        timer.record(last, calls((0.0, 4.0, 4), (5.0, 11.0, 6)))  # host time between: left out
    timer.record(50, calls((0.0, 25.0, 10)), during_save=True)  # 2.5 s a step
    assert timer.median_step_s() == pytest.approx(1.0)
    assert [w.steps for w in timer.clean()] == [10, 10, 10]
    assert timer.background_slowdown_s() == pytest.approx(15.0)  # 25 s, where 10 s was due
    assert timer.compute_s() == pytest.approx(9.0 + 3 * 10.0 + 25.0)
    assert timer.first_calls_s == pytest.approx(34.0)
