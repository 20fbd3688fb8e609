"""Where metrics go: every writer reads back what metrics.jsonl holds; the console draws a bar
on a terminal and plain lines elsewhere; only process 0 writes."""

from __future__ import annotations

import io
import json
import struct
import sys

import numpy as np
import pytest
from conftest import run_python

from trainrun import rundir
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.reporting.console import ConsoleLog
from trainrun.reporting.run_output import build_output
from trainrun.reporting.sinks.jsonl import JsonlWriter, read_metrics
from trainrun.reporting.sinks.tensorboard import (
    TENSORBOARD_DIR,
    TENSORBOARDX_BUCKET_CLIENTS,
    TensorBoardWriter,
)
from trainrun.reporting.table import Table
from trainrun.training.loop import run

QUICK = ["steps=60", "metrics.every=20", "checkpoint.every=0"]


class Terminal(io.StringIO):
    """Output that says it is a terminal, as a console window would."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("writers") / "run"
    out = io.StringIO()
    run(load_config("mlp", QUICK), run_dir, out=out)
    return run_dir, out.getvalue()


def test_tensorboard_event_file_reads_back_the_jsonl_losses(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = finished_run
    jsonl = read_metrics(run_dir / rundir.METRICS)
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    events.Reload()
    for name in ("loss", "lr", "grad_norm"):
        scalars = events.Scalars(f"train/{name}")
        assert [s.step for s in scalars] == [r["step"] for r in jsonl] == list(range(1, 61))
        # TensorBoard stores float32, which is what the device computed: equal bit for bit.
        assert np.array([s.value for s in scalars], np.float32).tobytes() == \
            np.array([r[name] for r in jsonl], np.float32).tobytes()
    timing = events.Scalars("perf/step_time_s")
    assert [s.step for s in timing] == [20, 40, 60] and all(s.value > 0 for s in timing)


def test_plain_lines_when_not_a_terminal(finished_run):
    _, text = finished_run
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["20/60", "40/60", "60/60"]
    assert "examples/s" in lines[0]
    assert "\r" not in text and "\x1b" not in text  # no redraws, no escape codes


def test_progress_bar_on_a_terminal(tmp_path):
    out = Terminal()
    run(load_config("mlp", QUICK), tmp_path / "run", out=out)
    text = out.getvalue()
    assert "━" in text and "ETA" in text and "examples/s" in text  # the bar and its fields
    frames = text.split("\r")
    assert "step 60/60" in frames[-1]
    # Drawn at log points only: a handful of frames, not one per step.
    assert len(frames) < 12
    assert "done: 60 steps" in text  # the summary still prints after the bar


def test_only_process_zero_writes(tmp_path):
    console = ConsoleLog(10, 1, io.StringIO())
    output = build_output(tmp_path, console, log_every=5, total_steps=10, primary=False)
    row = Table(5, ["loss", "lr"], np.float32([[1.0, 0.1]]))
    output.write_table(row)
    output.write_window(5, 5, 1e-3, 1)
    output.close()
    assert list(tmp_path.iterdir()) == []
    assert console.out.getvalue() == ""  # nor does it print: process 0 does

    output = build_output(tmp_path, ConsoleLog(10, 1, io.StringIO()), log_every=5,
                          total_steps=10, primary=True)
    output.write_table(row)
    output.close()
    [record] = read_metrics(tmp_path / rundir.METRICS)
    assert record == {"step": 5, "loss": 1, "lr": 0.100000001}  # float32 0.1 to 9 digits
    assert np.float32(record["lr"]) == np.float32(0.1)


def _wandb_history(path) -> list[dict]:
    """The logged rows of an offline W&B run file (a LevelDB-style log of Record protos)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    block, pos, pending, rows = 32768, 7, b"", []  # 7: the file header (":W&B", magic, version)
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):  # full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_same_losses(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run(load_config("mlp", [*QUICK, "metrics.wandb=offline"]), run_dir, out=io.StringIO())
    [wandb_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = [r for r in _wandb_history(wandb_file) if "train/loss" in r]
    jsonl = read_metrics(run_dir / rundir.METRICS)
    logged = [r for r in jsonl if r["step"] % 20 == 0]  # W&B takes train rows at log points
    assert [r["_step"] for r in rows] == [r["step"] for r in logged] == [20, 40, 60]
    assert np.array([r["train/loss"] for r in rows], np.float32).tobytes() == \
        np.array([r["loss"] for r in logged], np.float32).tobytes()
    perf = [r for r in _wandb_history(wandb_file) if "perf/step_time_s" in r]
    assert len(perf) == 3 and all(r["perf/step_time_s"] > 0 for r in perf)


def test_wandb_asked_for_but_missing_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    code = main(["train", "--run-dir", str(tmp_path / "run"), *QUICK, "metrics.wandb=offline"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ("error: config key 'metrics.wandb': 'offline' needs the wandb extra: "
                   "pip install 'trainrun[wandb]', or set metrics.wandb=off\n")
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_jsonl_lines_are_what_json_dumps_writes(tmp_path):
    writer = JsonlWriter(tmp_path / "m.jsonl")
    rows = [(1, {"loss": 0.1 + 0.2, "lr": np.float32(1e-3).item(), "count": 3}, "train"),
            (2, {"loss": float("inf"), "grad_norm": float("nan")}, "train"),
            (3, {"loss": 1e-300, "accuracy": 0.5}, "eval")]
    for step, metrics, split in rows:
        writer.write(step, metrics, split)
    writer.close()
    expected = [{"step": 1, "loss": 0.1 + 0.2, "lr": np.float32(1e-3).item(), "count": 3},
                {"step": 2, "loss": None, "grad_norm": None, "nonfinite": ["loss", "grad_norm"]},
                {"step": 3, "split": "eval", "loss": 1e-300, "accuracy": 0.5}]
    assert (tmp_path / "m.jsonl").read_text() == "".join(json.dumps(e) + "\n" for e in expected)


def test_a_table_of_float32_rows_reads_back_bit_for_bit(tmp_path):
    # Random bit patterns: every exponent, denormals, both zeros, NaN and inf; the short text
    # of write_table (9 digits) must read back to the very float32 the device produced.
    bits = np.random.default_rng(0).integers(0, 2**32, (2000, 5), dtype=np.uint64)
    values = bits.astype(np.uint32).view(np.float32)
    values[0] = [-0.0, 0.0, 1.0, np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal]
    values[1, :3] = [np.nan, np.inf, -np.inf]
    names = ["a", "b", "c", "d", "e"]
    writer = JsonlWriter(tmp_path / "m.jsonl")
    writer.write_table(Table(7, names, values))
    writer.close()
    records = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in records] == list(range(7, 7 + len(values)))
    read = np.array([[np.nan if r[n] is None else r[n] for n in names] for r in records],
                    np.float32)
    finite = np.isfinite(values)
    assert (read[finite].view(np.uint32) == values[finite].view(np.uint32)).all()
    assert np.isnan(read[~finite]).all()  # written as null and named
    assert records[1]["nonfinite"] == ["a", "b", "c"]
    assert str(records[0]["a"]) == "-0.0" and np.signbit(read[0, 0])
    assert sum(np.isfinite(values).all(axis=1)) > 1500  # most rows took the template
    # A row at a time (metrics.stream's path, checked in Python, not numpy): the same text.
    rows = JsonlWriter(tmp_path / "rows.jsonl")
    for i in range(40):
        rows.write_table(Table(7 + i, names, values[i:i + 1]))
    rows.close()
    assert (tmp_path / "rows.jsonl").read_text().splitlines() == \
        (tmp_path / "m.jsonl").read_text().splitlines()[:40]


def test_event_file_frames_records_as_tensorboardx_does(tmp_path):
    from tensorboardX.crc32c import crc32c
    from tensorboardX.record_writer import RecordWriter

    from trainrun.reporting.sinks.tensorboard import EventFile

    records = [b"", b"x", bytes(range(256)) * 3, b"event" * 1000, b"y", b"z"]
    ours = EventFile(tmp_path / "ours", crc32c)
    ours.write(records[:1])
    ours.write(records[1:4])  # several records framed together in one write
    ours.write_batches([np.frombuffer(b"yz", np.uint8).reshape(2, 1)])  # two of one length
    ours.close()
    theirs = RecordWriter(str(tmp_path / "theirs"))
    for data in records:
        theirs.write(data)
    theirs.close()
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes()


def test_scalar_events_are_the_bytes_protobuf_writes():
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    from trainrun.reporting.sinks.tensorboard import ScalarEventEncoder

    def protobuf(step, wall, split, names, row):
        value = [Summary.Value(tag=f"{split}/{n}", simple_value=v)
                 for n, v in zip(names, row, strict=True)]
        return Event(wall_time=wall, step=step, summary=Summary(value=value)).SerializeToString()

    bits = np.random.default_rng(2).integers(0, 2**32, (300, 3), dtype=np.uint64)
    values = bits.astype(np.uint32).view(np.float32)  # NaNs, infs, denormals, both zeros
    values[0] = [-0.0, np.inf, np.nan]
    names = ["loss", "n" * 130, "lr"]  # a tag over 127 bytes: a two-byte length
    encoder = ScalarEventEncoder()
    # steps whose varint is 0 (step 0 is not written), 1, 2, 3 and 6 bytes long, and tables
    # that cross from one length to the next
    for first in [0, 1, 100, 16300, 2**21 - 5, 2**40]:
        batches = encoder.encode(first, 1764567890.25, "train", names, values)
        ours = [bytes(record) for batch in batches for record in batch]
        assert ours == [protobuf(first + i, 1764567890.25, "train", names, row)
                        for i, row in enumerate(values.tolist())]
    row = {"step_time_s": 1e-300, "big": 1e300, "count": 3}  # Python numbers: rounded as protobuf
    [batch] = encoder.encode(7, 2.5, "perf", list(row), [list(row.values())])
    assert bytes(batch[0]) == protobuf(7, 2.5, "perf", list(row), list(row.values()))


def test_a_table_reads_back_from_tensorboard_as_float32(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = np.random.default_rng(1).normal(size=(300, 2)).astype(np.float32)
    writer = TensorBoardWriter(tmp_path)
    writer.write_table(Table(11, ["a", "b"], values[:100]))
    writer.write_table(Table(111, ["a", "b"], values[100:105]))  # small: through protobuf
    writer.write_table(Table(116, ["a", "b"], values[105:]))
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    for column, name in enumerate(["a", "b"]):
        scalars = events.Scalars(f"train/{name}")
        assert [s.step for s in scalars] == list(range(11, 311))
        assert np.float32([s.value for s in scalars]).tobytes() == values[:, column].tobytes()


TENSORBOARDX_IN_A_PROCESS = """
    import contextlib, json, sys
    from pathlib import Path
    import numpy as np
    from trainrun.platform.process import command_process
    from trainrun.reporting.sinks.tensorboard import (TENSORBOARDX_BUCKET_CLIENTS,
                                                       TensorBoardWriter)
    from trainrun.reporting.table import Table
    with command_process() if sys.argv[1] == "program" else contextlib.nullcontext():
        writer = TensorBoardWriter(Path(sys.argv[2]))
        writer.write_table(Table(1, ["loss"], np.float32([[2.5], [1.25]])))
        writer.close()
        from tensorboardX import record_writer
        print(json.dumps({"loaded": sorted(m for m in TENSORBOARDX_BUCKET_CLIENTS
                                           if m in sys.modules),
                          "writers": [record_writer.S3_ENABLED, record_writer.GCS_ENABLED]}))
"""


@pytest.mark.parametrize("process", ["program", "library"])
def test_tensorboardx_bucket_clients_are_left_unloaded_in_the_programs_process_alone(
        process, tmp_path):
    """The ``trainrun`` program's process imports tensorboardX without the S3 and GCS clients
    its bucket writers need (trainrun writes its events itself); in a library user's process
    tensorboardX keeps those writers, as its import makes them."""
    from importlib.util import find_spec

    def found(module: str) -> bool:
        try:
            return find_spec(module) is not None
        except ModuleNotFoundError:  # a parent missing: `google` without `google.cloud`
            return False

    pytest.importorskip("tensorboard")
    installed = sorted(m for m in TENSORBOARDX_BUCKET_CLIENTS if found(m))
    if not installed:
        pytest.skip("neither boto3 nor google-cloud-storage is installed")
    done = run_python(TENSORBOARDX_IN_A_PROCESS, process, str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads(done.stdout)
    if process == "program":
        assert after == {"loaded": [], "writers": [False, False]}
    else:
        assert after["loaded"] == installed
        assert after["writers"] == [m in installed for m in ("boto3", "google.cloud.storage")]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [(1, 2.5), (2, 1.25)]


def test_a_resumed_run_replaces_the_tensorboard_steps_it_redoes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardWriter(tmp_path)  # wrote up to step 50, then died; checkpoint at 40
    for step in range(1, 51):
        first.write(step, {"loss": 1.0})
    first.close()
    resumed = TensorBoardWriter(tmp_path, start_step=40)
    for step in range(41, 61):
        resumed.write(step, {"loss": 2.0})
    resumed.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [s.step for s in scalars] == list(range(1, 61))  # each step once
    assert [s.value for s in scalars] == [1.0] * 40 + [2.0] * 20  # redone steps: the new values
