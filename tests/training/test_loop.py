"""The loop and what it leaves in the run directory."""

from __future__ import annotations

import io
import json
import threading
import time

import jax
import numpy as np
import pytest
import yaml

from trainrun import rundir
from trainrun.config import load_config
from trainrun.errors import UserCodeFailed, WriteFailed
from trainrun.models import build_model
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.reporting.sinks.jsonl import JsonlWriter, read_metrics
from trainrun.reporting.timing import Stopwatch
from trainrun.training.callbacks import Boundary, Call, Callback
from trainrun.training.loop import run

SUMMARY_KEYS = {"final_loss", "steps", "compile_s", "step_time_median_s", "steps_per_s",
                "examples_per_s", "provenance"}
PROVENANCE_KEYS = {"trainrun", "jax", "jaxlib", "backend", "device_kind", "device_count",
                   "process_count", "python", "xla_flags", "config_digest"}


def test_run_directory_holds_config_provenance_metrics_and_summary(tmp_path):
    config = load_config("mlp", ["steps=30", "metrics.every=10"])
    out = io.StringIO()
    summary = run(config, tmp_path, out=out)

    assert yaml.safe_load((tmp_path / rundir.CONFIG).read_text()) == config.to_dict()
    provenance = json.loads((tmp_path / rundir.PROVENANCE).read_text())
    assert provenance.keys() >= PROVENANCE_KEYS
    assert provenance["config_digest"] == config.digest()

    records = read_metrics(tmp_path / rundir.METRICS)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all({"loss", "lr", "grad_norm"} <= r.keys() for r in records)

    saved = json.loads((tmp_path / rundir.SUMMARY).read_text())
    assert saved.keys() >= SUMMARY_KEYS
    assert saved["final_loss"] == summary.final_loss  # the float32 loss, exactly, as a double
    assert np.float32(saved["final_loss"]) == np.float32(records[-1]["loss"])  # and to 9 digits
    assert saved["steps_per_s"] > 0 and saved["compile_s"] > 0
    assert saved["examples_per_s"] == saved["steps_per_s"] * 256

    lines = out.getvalue().splitlines()
    assert sum(line.startswith("step ") for line in lines) == 3  # steps 10, 20, 30
    assert any("compile" in line for line in lines)
    assert any("provenance" in line and f"jax {jax.__version__}," in line for line in lines)


@pytest.mark.slow
def test_metrics_file_reads_back_float32_bit_for_bit(tmp_path):
    """Losses in metrics.jsonl are the device's float32 values exactly."""
    config = load_config("mlp", ["steps=5"])
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    state = init_state(model, optimizer, config.seed)
    steps = CompiledSteps(model, optimizer, 1, Stopwatch())
    from trainrun.data import batch_iterator, build_dataset

    batches = batch_iterator(build_dataset(config.data, config.seed))
    device_losses = []
    loss_column = None
    for _ in range(5):
        state, packed = steps(1, state, next(batches))
        loss_column = steps.metric_names.index("loss")
        device_losses.append(np.asarray(packed)[loss_column])
    run(config, tmp_path, out=io.StringIO())
    written = np.array([r["loss"] for r in read_metrics(tmp_path / rundir.METRICS)], np.float32)
    assert written.tobytes() == np.array(device_losses, np.float32).tobytes()


def test_batch_is_an_argument_not_a_constant_baked_into_the_program():
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    state = init_state(model, optimizer, config.seed)
    steps = CompiledSteps(model, optimizer, 1, Stopwatch())
    batch = {"x": np.ones((256, 8), np.float32), "y": np.ones((256, 1), np.float32)}
    hlo = steps.fn.lower(state, batch).as_text()
    assert "tensor<256x8xf32>" in hlo  # the batch comes in as a parameter
    assert "dense<" not in "\n".join(line for line in hlo.splitlines() if "256x8" in line)


class CallLog(Callback):
    """Every call of a run, as its boundaries list them (``Boundary.calls``)."""

    every_boundary = False  # the run's own boundaries only: the calls run as without it

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def at_boundary(self, boundary: Boundary) -> None:
        self.calls += boundary.calls


@pytest.mark.slow
def test_a_short_tail_call_is_compiled_once(tmp_path):
    config = load_config("mlp", ["steps=25", "steps_per_call=10"])
    log = CallLog()
    run(config, tmp_path, out=io.StringIO(), callbacks=[log])
    assert [call.steps for call in log.calls] == [10, 10, 5]
    assert [call.first_run for call in log.calls] == [True, False, True]  # two programs
    assert len(read_metrics(tmp_path / rundir.METRICS)) == 25


def test_base_key_never_changes_and_step_counts_updates():
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    state = init_state(model, optimizer, config.seed)
    key_before = jax.random.key_data(state.key).copy()
    steps = CompiledSteps(model, optimizer, 1, Stopwatch())
    batch = {"x": np.ones((256, 8), np.float32), "y": np.ones((256, 1), np.float32)}
    for _ in range(3):
        state, _ = steps(1, state, batch)
    assert int(state.step) == 3
    assert np.array_equal(jax.random.key_data(state.key), key_before)


@pytest.mark.slow
def test_existing_run_is_never_overwritten(tmp_path, cli):
    first = cli("train", "--run-dir", str(tmp_path / "r"), "steps=3")
    assert first.returncode == 0, first.stderr
    metrics = (tmp_path / "r" / rundir.METRICS).read_text()
    again = cli("train", "--run-dir", str(tmp_path / "r"), "steps=3", "optimizer.lr=0.5")
    assert again.returncode != 0 or "finished" in again.stdout + again.stderr
    assert (tmp_path / "r" / rundir.METRICS).read_text().startswith(metrics.splitlines()[0])


def test_a_run_of_first_calls_only_reports_their_rate_and_says_so(tmp_path):
    # steps=12 at K=10: a call of 10 and a call of 2, each its program's first run. Their
    # time (one-time set-up included) is the only step time there is: the log lines show it,
    # marked, instead of a rate from the wall clock around a compile (it read 16,112 steps/s
    # for a byte LM taking 90 ms a step); timing.jsonl holds no window of zero steps.
    config = load_config("mlp", ["steps=12", "steps_per_call=10", "metrics.every=4"])
    out = io.StringIO()
    summary = run(config, tmp_path / "run", out=out)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(lines) == 3
    assert all("first run of its program" in line for line in lines)
    rates = [float(line.split("steps/s")[0].split()[-1].replace(",", "")) for line in lines]
    assert rates[0] == rates[1]  # steps 4 and 8: the same call of 10 steps
    first_calls_s = summary.wall_time_split_s["first_calls"]
    assert 10 / rates[0] + 2 / rates[2] == pytest.approx(first_calls_s, rel=0.01)
    assert summary.step_time_from_first_runs
    assert (summary.warmup_windows, summary.timed_windows) == (1, 1)  # of the two first calls
    assert "first runs of the programs only" in out.getvalue()
    assert (tmp_path / "run" / "timing.jsonl").read_text() == ""


def test_rows_are_written_by_a_writer_thread_while_the_loop_goes_on(tmp_path, monkeypatch):
    # Each table's JSONL write made slow: the loop still dispatches calls while one is being
    # written, and every row ends up in the file, in step order.
    writes: list[tuple[str, float, float]] = []
    write_table = JsonlWriter.write_table

    def slow_write_table(self, table, split="train"):
        start = time.perf_counter()
        time.sleep(0.02)
        write_table(self, table, split)
        writes.append((threading.current_thread().name, start, time.perf_counter()))

    monkeypatch.setattr(JsonlWriter, "write_table", slow_write_table)
    config = load_config("mlp", ["steps=400", "steps_per_call=10", "metrics.every=20",
                                 "checkpoint.every=0", "checkpoint.every_seconds=0"])
    log = CallLog()
    summary = run(config, tmp_path, out=io.StringIO(), callbacks=[log])
    dispatches = [call.dispatched_at for call in log.calls]
    assert len(dispatches) == 40
    assert writes and all(name.startswith("trainrun-metrics") for name, _, _ in writes)
    assert any(start < t < end for _, start, end in writes for t in dispatches)
    assert [r["step"] for r in read_metrics(tmp_path / rundir.METRICS)] == list(range(1, 401))
    # 20 writes of 20 ms outlast 40 calls: the wait for them (the final checkpoint flushes the
    # rows first) is logging in the wall-time split
    assert summary.wall_time_split_s["logging"] > 0.2


def test_a_write_that_fails_on_the_writer_thread_fails_the_run(tmp_path, monkeypatch):
    # The failure is raised in the loop's thread and becomes the run's one-line error.
    tables = []

    def failing_write_table(self, table, split="train"):
        tables.append(table.first)
        if len(tables) == 2:
            raise OSError(28, "No space left on device", "metrics.jsonl")

    monkeypatch.setattr(JsonlWriter, "write_table", failing_write_table)
    config = load_config("mlp", ["steps=400", "steps_per_call=10", "metrics.every=20"])
    with pytest.raises(WriteFailed, match=r"no space left on device writing metrics\.jsonl"):
        run(config, tmp_path, out=io.StringIO())
    assert rundir.read_status(tmp_path)["status"] == "failed"


@pytest.mark.slow
def test_a_failed_run_records_the_step_of_its_last_committed_checkpoint(tmp_path):
    """Before, status.json kept the step the run started at (0) though checkpoints existed."""

    class Crash(Callback):
        every = 6

        def at_boundary(self, boundary):
            if boundary.step == 12:
                boundary.wait_for_checkpoint()
                raise RuntimeError("a bug in a callback")

    config = load_config("mlp", ["steps=40", "steps_per_call=2", "checkpoint.every=4",
                                 "checkpoint.async=false", "metrics.tensorboard=false"])
    with pytest.raises(UserCodeFailed, match="a bug in a callback"):
        run(config, tmp_path, out=io.StringIO(), callbacks=[Crash()])
    status = rundir.read_status(tmp_path)
    assert status["status"] == "failed" and "a bug in a callback" in status["reason"]
    committed = rundir.committed_steps(tmp_path / rundir.CHECKPOINTS)
    assert committed and status["step"] == committed[-1] > 0
