"""metrics.stream: each step's metrics leave a fused K-step call while it runs, in order, each
exactly once, with the values the unstreamed run writes; with streaming off the program is
unchanged."""

from __future__ import annotations

import io
import threading

import jax
import numpy as np
import pytest

from trainrun import rundir
from trainrun.config import load_config
from trainrun.models import build_model
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state, init_state
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.reporting.stream import MetricStream
from trainrun.reporting.timing import Stopwatch
from trainrun.training import loop, setup

K10 = ["steps=100", "steps_per_call=10", "metrics.every=50", "checkpoint.every=0"]


@pytest.mark.slow
def test_streamed_metrics_arrive_in_order_and_complete(tmp_path, monkeypatch):
    arrived: list[int] = []

    class Recording(MetricStream):
        def __call__(self, step, names, values):
            arrived.append(step)
            super().__call__(step, names, values)

    monkeypatch.setattr(setup, "MetricStream", Recording)
    loop.run(load_config("mlp", [*K10, "metrics.stream=true"]), tmp_path / "streamed",
             out=io.StringIO())
    monkeypatch.undo()
    loop.run(load_config("mlp", K10), tmp_path / "read", out=io.StringIO())

    assert arrived == list(range(1, 101))  # in order, none lost, none twice
    streamed_rows = read_metrics(tmp_path / "streamed" / rundir.METRICS)
    read_rows = read_metrics(tmp_path / "read" / rundir.METRICS)
    assert [r["step"] for r in streamed_rows] == list(range(1, 101))
    assert streamed_rows == read_rows  # the same values, written once each


def _step_program(stream, concrete=True):
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 100)
    programs = CompiledSteps(model, optimizer, 10, Stopwatch(), stream=stream)
    state = (init_state if concrete else abstract_state)(model, optimizer, 0)
    x = np.ones((10, 256, 8), np.float32)
    batch = {"x": x, "y": x.sum(-1, keepdims=True)}
    return programs, state, batch


def test_rows_leave_while_the_call_is_still_running():
    rows: list[int] = []
    first_row, release = threading.Event(), threading.Event()

    def emit(step, names, values):
        rows.append(step)
        if len(rows) == 1:
            first_row.set()
            assert release.wait(60)  # hold the call inside step 1 until the test has looked

    programs, state, batch = _step_program(emit)
    programs.compile(10, state, batch)
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(out=programs(10, state, batch)))
    worker.start()
    assert first_row.wait(60)
    # Step 1's row is out; the call has not finished (on CPU it has not even returned).
    out = result.get("out")
    assert rows == [1] and (out is None or not out[1].is_ready())
    release.set()
    worker.join(60)
    jax.block_until_ready(result["out"])
    assert rows == list(range(1, 11))


def test_streaming_off_leaves_the_program_as_it_was():
    def has_callback(programs, state, batch) -> bool:
        text = programs.fn.lower(state, batch).as_text()
        return "callback" in text

    assert not has_callback(*_step_program(None, concrete=False))
    assert has_callback(*_step_program(lambda *row: None, concrete=False))
