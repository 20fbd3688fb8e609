"""The user's code in a run (callbacks, a model's functions, data iterators): whatever it raises,
``SystemExit`` and ``KeyboardInterrupt`` included, fails the run with one line naming the
function, the last committed checkpoint kept; a real Ctrl-C still stops it with a checkpoint."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

import trainrun
from trainrun import rundir
from trainrun.config import RegressionData, load_config
from trainrun.data.synthetic import regression_arrays
from trainrun.models import from_functions

HERE = Path(__file__).name
SMALL = ["steps=6", "steps_per_call=1", "checkpoint.every=2", "checkpoint.async=false",
         "metrics.tensorboard=false"]
RAISED = {"SystemExit(0)": SystemExit(0), "SystemExit(None)": SystemExit(None),
          "KeyboardInterrupt()": KeyboardInterrupt(), "ValueError('a bug')": ValueError("a bug")}


class Quits(trainrun.Callback):
    """At step 3: raises ``RAISED[how]``, or with ``how`` "SIGINT" sends this process SIGINT."""

    def __init__(self, how: str):
        self.how = how

    def at_boundary(self, boundary: trainrun.Boundary) -> None:
        if boundary.step != 3:
            return
        if self.how == "SIGINT":
            os.kill(os.getpid(), signal.SIGINT)
            return
        raise RAISED[self.how]


def failed_run(tmp_path: Path, started: bool = True, **run_args) -> str:
    """``trainrun.run`` of the small MLP run with ``run_args``: its ``UserCodeFailed`` line, on
    one line; a run that ``started`` has it as its failed status's reason."""
    with pytest.raises(trainrun.UserCodeFailed) as failed:
        trainrun.run(load_config("mlp", SMALL), tmp_path, out=io.StringIO(), **run_args)
    line = str(failed.value)
    assert "\n" not in line
    if started:
        status = rundir.read_status(tmp_path)
        assert status["status"] == "failed" and status["reason"] == line
    return line


@pytest.mark.parametrize("how", list(RAISED))
def test_a_callback_that_raises_or_exits_fails_the_run_naming_it(tmp_path, how):
    line = failed_run(tmp_path, callbacks=[Quits(how)])
    assert line.startswith(f"callback Quits.at_boundary ({__file__}:")
    assert line.endswith(f"raised {how}; the last committed checkpoint is step 2 (the same "
                         "command resumes from it once the code is fixed)")
    # the checkpoint before the failure is kept, and nothing after it was written
    assert rundir.committed_steps(tmp_path / rundir.CHECKPOINTS) == [2]
    assert rundir.read_status(tmp_path)["step"] == 2


@pytest.mark.slow
def test_a_raised_keyboard_interrupt_fails_the_run_where_ctrl_c_stops_it(tmp_path):
    summary = trainrun.run(load_config("mlp", SMALL), tmp_path / "signal", out=io.StringIO(),
                           callbacks=[Quits("SIGINT")])
    assert summary.status == "preempted"  # the signal's: a checkpoint at the next boundary
    assert rundir.committed_steps(tmp_path / "signal" / rundir.CHECKPOINTS) == [2, 4]
    assert rundir.read_status(tmp_path / "signal")["status"] == "preempted"

    line = failed_run(tmp_path / "raised", callbacks=[Quits("KeyboardInterrupt()")])
    assert "raised KeyboardInterrupt()" in line
    assert rundir.committed_steps(tmp_path / "raised" / rundir.CHECKPOINTS) == [2]


def batches_then_exit(steps: int):
    """The MLP's batches for ``steps`` steps, then ``sys.exit(0)`` (a user's generator)."""
    for _ in range(steps):
        yield regression_arrays(RegressionData())
    sys.exit(0)


@pytest.mark.slow
def test_a_data_iterator_that_exits_fails_the_run_naming_it(tmp_path):
    line = failed_run(tmp_path, data=batches_then_exit(4))
    assert line.startswith(f"data iterator batches_then_exit ({__file__}:")
    assert "raised SystemExit(0); the last committed checkpoint is step 4" in line


def test_a_model_function_that_raises_fails_the_run_naming_it_and_where(tmp_path):
    def init(key):
        return {"w": np.zeros((8, 1), np.float32)}

    def checked(x):
        raise ValueError(f"x has {x.shape[-1]} features")

    def loss(params, batch, key):
        return checked(batch["x"])

    # traced as the run is set up, before anything is written
    line = failed_run(tmp_path, started=False, model=from_functions(init, loss))
    assert not any(tmp_path.iterdir())
    qualname = "test_a_model_function_that_raises_fails_the_run_naming_it_and_where.<locals>"
    assert line.startswith(f"model function {qualname}.loss ({__file__}:")
    assert (f"raised ValueError('x has 8 features') in {qualname}.checked ({__file__}:"
            in line)
    assert line.endswith("no checkpoint was committed")
