"""User callbacks: every boundary in order with every metrics row once, a stop that ends the run
with its final checkpoint and status finished, early stopping and keep-best on the digits run."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest
from conftest import cli_env

import trainrun
from trainrun import rundir
from trainrun.config import load_config
from trainrun.reporting.sinks.jsonl import read_metrics


class Recorder(trainrun.Callback):
    def __init__(self, every: int = 0, every_boundary: bool = True):
        self.every = every
        self.every_boundary = every_boundary
        self.steps: list[int] = []
        self.call_sizes: list[int] = []  # the steps of every call, as the boundaries list them
        self.rows: list[int] = []
        self.read_through: list[int] = []  # the newest row seen at each boundary
        self.closed = False

    def at_boundary(self, boundary: trainrun.Boundary) -> None:
        self.steps.append(boundary.step)
        self.call_sizes += [call.steps for call in boundary.calls]
        if boundary.table is not None:
            self.rows += [step for step, _ in boundary.table.rows()]
        self.read_through.append(self.rows[-1] if self.rows else 0)

    def close(self) -> None:
        self.closed = True


@pytest.mark.slow
def test_a_callback_sees_every_boundary_in_order_and_every_row_once(tmp_path):
    every_call, every_seventh = Recorder(), Recorder(every=7)
    config = load_config("mlp", ["steps=25", "steps_per_call=10", "metrics.every=10"])
    trainrun.run(config, tmp_path, out=io.StringIO(), callbacks=[every_call, every_seventh])

    sizes = every_call.call_sizes
    assert every_seventh.call_sizes == sizes
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    assert ends == [7, 14, 21, 25]  # calls cut at the callback's steps, at most K = 10
    assert every_call.steps == every_seventh.steps == ends
    assert every_call.rows == every_seventh.rows == list(range(1, 26))  # in order, once each
    assert every_seventh.read_through == ends  # at its steps, the rows up to that very step
    assert every_call.closed and every_seventh.closed


def test_calls_run_back_to_back_between_the_boundaries_the_hooks_need(tmp_path):
    # K=1, metrics.every=10: rows are read one call late, so with no hook asking for every call
    # the host stops after steps 11, 21, 31 (the reads) and 35 (the end) only.
    quiet, every_call = Recorder(every_boundary=False), Recorder()
    config = load_config("mlp", ["steps=35", "metrics.every=10"])
    trainrun.run(config, tmp_path / "quiet", out=io.StringIO(), callbacks=[quiet])
    assert quiet.call_sizes == [1] * 35
    assert quiet.steps == [11, 21, 31, 35]
    assert quiet.rows == list(range(1, 36))  # every row once, in order
    trainrun.run(config, tmp_path / "every", out=io.StringIO(), callbacks=[every_call])
    assert every_call.steps == list(range(1, 36))
    assert every_call.rows == quiet.rows


def test_a_callback_that_asks_for_every_step_makes_calls_of_one_step_and_says_so(tmp_path):
    out = io.StringIO()
    every_step = Recorder(every=1)
    trainrun.run(load_config("mlp", ["steps=12", "steps_per_call=4"]), tmp_path, out=out,
                 callbacks=[every_step])
    assert every_step.call_sizes == [1] * 12
    assert ("Recorder asks for a boundary every 1 step(s): calls run 1 step(s), not "
            "steps_per_call=4") in out.getvalue()


STOP_AT_12 = """
    import sys
    import trainrun

    class StopAt(trainrun.Callback):
        def at_boundary(self, boundary):
            if boundary.step == 12:
                boundary.stop("enough at 12")

    config = trainrun.load_config("mlp", ["steps=100", "metrics.every=5", "checkpoint.every=50"])
    summary = trainrun.run(config, sys.argv[1], callbacks=[StopAt()])
    print("steps done", summary.steps_done)
"""


@pytest.mark.slow
def test_a_callback_stops_the_run_with_its_final_checkpoint_and_status_finished(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(STOP_AT_12), str(run_dir)],
                          capture_output=True, text=True, timeout=300, env=cli_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped at step 12: enough at 12" in done.stdout and "steps done 12" in done.stdout
    assert rundir.committed_steps(run_dir / "checkpoints") == [12]
    assert rundir.read_status(run_dir)["status"] == "finished"
    summary = json.loads((run_dir / rundir.SUMMARY).read_text())
    assert (summary["steps_done"], summary["stopped_by"]) == (12, "enough at 12")
    assert [r["step"] for r in read_metrics(run_dir / rundir.METRICS)] == list(range(1, 13))


def digits(*overrides: str):
    return load_config("digits", ["steps=120", "steps_per_call=10", "eval.every=20",
                                  "metrics.every=60", "metrics.tensorboard=false", *overrides])


@pytest.mark.slow
def test_early_stopping_on_an_eval_metric_ends_the_digits_run(tmp_path):
    # An improvement must exceed 1.0 in accuracy: after the first evaluation none does, so the
    # run stops at the third (patience 2), with its checkpoint there.
    stop = trainrun.EarlyStopping("eval/accuracy", patience=2, mode="max", min_delta=1.0)
    summary = trainrun.run(digits(), tmp_path, out=io.StringIO(), callbacks=[stop])
    assert summary.steps_done == 60 and "eval/accuracy has not improved" in summary.stopped_by
    evals = read_metrics(tmp_path / rundir.METRICS, split="eval")
    assert [r["step"] for r in evals] == [20, 40, 60]
    assert rundir.committed_steps(tmp_path / "checkpoints")[-1] == 60
    assert rundir.read_status(tmp_path)["status"] == "finished"


@pytest.mark.slow
def test_keep_best_keeps_the_best_eval_checkpoint_beside_the_latest(tmp_path):
    for mode in ("max", "min"):  # max of the loss: the best is an early one, never the latest
        run_dir = tmp_path / mode
        summary = trainrun.run(digits("checkpoint.keep=1", "checkpoint.keep_best=eval/loss",
                                      f"checkpoint.keep_best_mode={mode}"),
                               run_dir, out=io.StringIO())
        losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / rundir.METRICS, "eval")}
        assert sorted(losses) == [20, 40, 60, 80, 100, 120]
        best = (max if mode == "max" else min)(losses, key=losses.get)
        assert summary.best_checkpoint == {"step": best, "eval/loss": losses[best]}
        assert rundir.committed_steps(run_dir / "checkpoints") == sorted({best, 120})
        if mode == "max":
            assert best != 120
