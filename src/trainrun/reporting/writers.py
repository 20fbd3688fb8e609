"""Where metrics go: the only module that writes them.

Every writer takes one step's metrics as plain Python floats through one small protocol
(``write`` and ``close``): ``metrics.jsonl`` always, TensorBoard event files (on by default),
Weights & Biases when installed and asked for. ``RunOutput`` fans a window of rows out to them
and to the console; only process 0 of a multi-process run builds any of them.

The loop reads metrics as tables, a window of consecutive steps at a time (``Table``). A writer
that also has ``write_table`` takes the whole table at once: the JSONL and TensorBoard writers
format it from a template made once per set of names, since on a fast step writing is a large
part of what the loop costs (BENCHMARKS.md, "Writing metrics").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from trainrun import extras, rundir
from trainrun.errors import UserError
from trainrun.reporting.console import Console, ConsoleLog
from trainrun.reporting.table import Table

TENSORBOARD_DIR = "tensorboard"


class WriterError(UserError):
    """A metrics destination that cannot be used as configured."""


class Writer(Protocol):
    """One destination of metrics (a file, a service)."""

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        """One step's metrics (an eval row, a timing window, a streamed row)."""

    def write_table(self, table: Table, split: str = "train") -> None:
        """Consecutive training steps' metrics at once."""

    def flush(self) -> None:
        """What was written so far reaches the destination."""

    def close(self) -> None: ...


def _number(value: float) -> float | None:
    # JSON has no NaN/inf: they are written as null (and named in the line's "nonfinite").
    return value if math.isfinite(value) else None


def float32_text(value: float) -> str:
    """A float32 value as text that reads back to it: 9 significant digits always suffice
    (IEEE 754's round-trip figure for binary32), so np.float32(loaded) == the value the device
    produced, bit for bit (a negative zero keeps its sign: "-0.0", not the integer "-0")."""
    text = f"{value:.9g}"
    return "-0.0" if text == "-0" else text


def _templatable(row: list[float]) -> bool:
    """Whether the ``%.9g`` template writes ``row`` as JSON that reads back exactly: every value
    finite (a non-finite sum says one is not, or that the sum overflowed: the slow path then)
    and no negative zero."""
    if not math.isfinite(sum(row)):
        return False
    return 0.0 not in row or all(math.copysign(1.0, x) > 0 for x in row if x == 0)


class JsonlWriter:
    """``metrics.jsonl``: one JSON object per step (and per eval), appended.

    A line written by ``write`` is what ``json.dumps`` writes for ``{"step": ..., "split": ...,
    **metrics}``, put together from cached key strings and ``float.__repr__`` (json's own float
    format), cheaper than ``json.dumps`` on a fast step. The training rows of ``write_table``
    hold float32 values, written with 9 significant digits (``%.9g``): the fewest that always
    read back to the same float32, and cheaper than ``repr`` of the value as a double, whose 17
    digits say no more.

    Whole lines are buffered (``BUFFER``) and written with ``os.write``; a write the file system
    refuses part way (a full disk) is cut back to where it began, so the file never ends inside
    a record, and nothing is written behind the caller's back when the writer is dropped.
    """

    BUFFER = 1 << 16

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        self.pending: list[str] = []
        self.pending_chars = 0
        self.keys: dict[str, str] = {}  # metric name -> ', "name": '
        self.templates: dict[tuple[str, tuple[str, ...]], str] = {}  # (split, names) -> line

    def _add(self, text: str) -> None:
        self.pending.append(text)
        self.pending_chars += len(text)
        if self.pending_chars >= self.BUFFER:
            self.flush()

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        self._add(self._line(step, metrics, split))

    def write_table(self, table: Table, split: str = "train") -> None:
        """The table's rows (float32 values, ``%.9g``), each through a ``%`` template made once
        per set of names; a row with a non-finite value (or a negative zero) through ``_line``."""
        names = tuple(table.names)
        template = self.templates.get((split, names))
        if template is None:
            head = '{"step": %d' + (f', "split": {json.dumps(split)}' if split != "train" else "")
            template = head + "".join(f", {json.dumps(n)}: %.9g" for n in names) + "}\n"
            self.templates[split, names] = template
        values = table.values
        rows = values.tolist()
        if len(rows) >= 16:  # vectorized; a row at a time (metrics.stream) costs less in Python
            plain = (np.isfinite(values).all(axis=1)
                     & ~(np.signbit(values) & (values == 0)).any(axis=1)).tolist()
        else:
            plain = [_templatable(row) for row in rows]
        self._add("".join(
            template % (table.first + i, *row) if plain[i]
            else self._line(table.first + i, dict(zip(names, row, strict=True)), split,
                            float32_text)
            for i, row in enumerate(rows)))

    def _line(self, step: int, metrics: Mapping[str, float], split: str,
              number_format: Callable[[float], str] = repr) -> str:
        parts = [f'{{"step": {int(step)}']
        if split != "train":
            parts.append(f', "split": {json.dumps(split)}')
        bad = []
        for name, value in metrics.items():
            key = self.keys.get(name) or self.keys.setdefault(name, f", {json.dumps(name)}: ")
            number = _number(value if type(value) is int else float(value))
            if number is None:
                bad.append(name)
            parts.append(key + ("null" if number is None else number_format(number)))
        if bad:
            parts.append(f', "nonfinite": {json.dumps(bad)}')
        parts.append("}\n")
        return "".join(parts)

    def flush(self) -> None:
        if not self.pending or self.fd is None:
            return
        data = memoryview("".join(self.pending).encode())
        self.pending.clear()
        self.pending_chars = 0
        start = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)  # no partial record (and the space back)
            raise OSError(err.errno, err.strerror, str(self.path)) from err

    def close(self) -> None:
        if self.fd is not None:
            try:
                self.flush()
            finally:
                os.close(self.fd)
                self.fd = None


def read_metrics(path: Path, split: str = "train") -> list[dict]:
    """The records of one split from a ``metrics.jsonl``, in file order."""
    with path.open() as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("split", "train") == split]


class TensorBoardWriter:
    """TensorBoard event files in ``logdir``, tags ``<split>/<metric>``: one event per step.

    Events are written synchronously (``EventFile``), not through tensorboardX's
    ``SummaryWriter``, whose bounded queue hands every scalar to another thread: that costs the
    digits CNN over 2% of its step (BENCHMARKS.md, "TensorBoard events"), its ``flush`` leaves
    queued events unwritten, and a full disk stops its thread and then blocks the caller. A
    table's events are encoded together (``ScalarEventEncoder``) and written in one call.
    A run resumed at step ``s`` starts its file with TensorBoard's restart marker, so
    steps after ``s`` that an earlier process wrote are dropped from the charts instead of
    drawn twice.
    """

    def __init__(self, logdir: Path, start_step: int = 0):
        crc32c, Event, SessionLog = _tensorboardx()
        logdir.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a directory's files in name order: the time (to the µs) keeps a
        # resumed run's file after the earlier one's, even within one second and one process.
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self.records = EventFile(logdir / name, crc32c)
        first = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if start_step:  # TensorBoard drops earlier events from this step on: the ones redone
            first.append(Event(wall_time=time.time(), step=start_step + 1,
                               session_log=SessionLog(status=SessionLog.START)))
        self.records.write([event.SerializeToString() for event in first])
        self.encoder = ScalarEventEncoder()

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        self.records.write(self.encoder.messages(step, time.time(), split, list(metrics),
                                                 [list(metrics.values())]))

    def write_table(self, table: Table, split: str = "train") -> None:
        # one wall time: the rows were read together
        if len(table.values) < ScalarEventEncoder.MIN_ROWS:
            self.records.write(self.encoder.messages(table.first, time.time(), split,
                                                     table.names, table.values.tolist()))
        else:
            self.records.write_batches(self.encoder.encode(table.first, time.time(), split,
                                                           table.names, table.values))

    def flush(self) -> None:
        self.records.flush()

    def close(self) -> None:
        self.records.close()


class EventFile:
    """An event file as TensorBoard reads it: TFRecords (the length, its masked CRC-32C, the
    serialized ``Event``, its masked CRC-32C), appended; byte for byte what tensorboardX's
    ``RecordWriter`` writes (tests/reporting/test_writers.py). Records of one length are framed
    together with NumPy, one checksum call each, and written in one call. Refused writes name
    the file (the run's one-line report needs it)."""

    def __init__(self, path: Path, crc32c: Callable[[Any], int]):
        self.path = path
        self.crc = crc32c
        self.file = open(path, "wb")  # noqa: SIM115  # open for the run's life; close() closes

    def write(self, records: list[bytes]) -> None:
        """Serialized records, any lengths, framed one by one (a few records: no NumPy)."""
        crc, pack = self.crc, struct.pack
        frames: list[bytes] = []
        for data in records:
            length = pack("<Q", len(data))
            frames += (length, pack("<I", _masked(crc(length))), data,
                       pack("<I", _masked(crc(data))))
        self._named(self.file.write, b"".join(frames))

    def write_batches(self, batches: list[np.ndarray]) -> None:
        """Batches of records, each a ``[n, length]`` uint8 array (n records of one length)."""
        self._named(self.file.write, b"".join(self._frames(b) for b in batches if len(b)))

    def _frames(self, records: np.ndarray) -> bytes:
        count, length = records.shape
        head = struct.pack("<Q", length)
        data = records.tobytes()
        view = memoryview(data)
        crcs = _masked(np.array([self.crc(view[i:i + length])
                                 for i in range(0, count * length, length)] if length else
                                [self.crc(b"")] * count, np.uint64))
        frames = np.empty((count, 16 + length), np.uint8)
        frames[:, :8] = np.frombuffer(head, np.uint8)
        frames[:, 8:12] = np.frombuffer(struct.pack("<I", _masked(self.crc(head))), np.uint8)
        frames[:, 12:12 + length] = records
        frames[:, 12 + length:] = crcs.astype("<u4").view(np.uint8).reshape(count, 4)
        return frames.tobytes()

    def flush(self) -> None:
        """Written through to the disk (rows before a checkpoint survive a kill)."""
        self._named(self.file.flush)
        self._named(os.fsync, self.file.fileno())

    def close(self) -> None:
        if not self.file.closed:
            self._named(self.file.close)

    def _named(self, operation: Callable[..., Any], *args: Any) -> None:
        try:
            operation(*args)
        except OSError as err:
            if err.filename:
                raise
            raise OSError(err.errno, err.strerror, str(self.path)) from err


def _masked(crc: Any) -> Any:
    """TFRecord's masked CRC-32C of a raw one (an int or a uint64 array)."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    """Protocol Buffers' base-128 varint of a non-negative int."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class ScalarEventEncoder:
    """Steps' scalars as serialized TensorBoard ``Event``s, tags ``<split>/<metric>``: the
    bytes protobuf writes for ``Event(wall_time, step, summary=Summary(value=[Value(tag,
    simple_value), ...]))`` (tests/reporting/test_writers.py compares them), laid out with NumPy
    for a whole table at once: every field but the step and the values is the same in each row,
    and the step's varint has one length over most tables. Framed too (``EventFile``), it
    costs less than one protobuf message refilled row by row (``messages``, which small tables
    still take); BENCHMARKS.md, "TensorBoard events"."""

    MIN_ROWS = 16  # fewer rows: ``messages`` costs less than laying out NumPy arrays

    def __init__(self) -> None:
        self.bodies: dict[tuple[str, tuple[str, ...]], tuple[bytes, np.ndarray]] = {}
        _, self.event, _ = _tensorboardx()
        # protoc's modules make their classes at import time, and tensorboardX ships no stubs.
        from tensorboardX.proto.summary_pb2 import (
            Summary,  # pyright: ignore[reportAttributeAccessIssue]
        )

        self.summary = Summary
        self.events: dict[tuple[str, tuple[str, ...]], tuple[Any, list[Any]]] = {}

    def messages(self, first: int, wall_time: float, split: str, names: list[str],
                 rows: list[list[float]]) -> list[bytes]:
        """The same events through protobuf itself: one message per (split, names), refilled
        for each row."""
        key = (split, tuple(names))
        if key not in self.events:
            event = self.event(summary=self.summary(value=[
                self.summary.Value(tag=f"{split}/{name}", simple_value=0.0) for name in names]))
            self.events[key] = (event, list(event.summary.value))
        event, slots = self.events[key]
        event.wall_time = wall_time
        encoded = []
        for step, row in enumerate(rows, first):
            event.step = step
            for slot, value in zip(slots, row, strict=True):
                slot.simple_value = value
            encoded.append(event.SerializeToString())
        return encoded

    def _body(self, split: str, names: list[str]) -> tuple[bytes, np.ndarray]:
        """The summary's bytes with zero values, and where each value's 4 bytes go in it."""
        key = (split, tuple(names))
        if key not in self.bodies:
            body, offsets = bytearray(), []
            for name in names:
                tag = f"{split}/{name}".encode()
                value = b"\x0a" + _varint(len(tag)) + tag + b"\x15"
                body += b"\x0a" + _varint(len(value) + 4) + value
                offsets.append(len(body))
                body += bytes(4)
            self.bodies[key] = (bytes(body), np.array(offsets))
        return self.bodies[key]

    def encode(self, first: int, wall_time: float, split: str, names: list[str],
               values: Any) -> list[np.ndarray]:
        """Events for steps ``first``, ``first + 1``, ... (``values[i]``: step ``first + i``),
        as ``[n, length]`` uint8 batches in step order (a step whose varint is longer starts
        a new batch)."""
        with np.errstate(over="ignore", invalid="ignore"):  # as protobuf: inf beyond range
            scalars = np.asarray(values, np.float64).astype("<f4").reshape(-1, len(names))
        body, offsets = self._body(split, names)
        wall = b"\x09" + struct.pack("<d", wall_time)
        batches = []
        for start, stop, size in _varint_runs(first, first + len(scalars)):
            step_field = b"\x10" + bytes(size) if size else b""  # proto3 leaves out step 0
            head = wall + step_field + b"\x2a" + _varint(len(body))
            records = np.empty((stop - start, len(head) + len(body)), np.uint8)
            records[:] = np.frombuffer(head + body, np.uint8)
            steps = np.arange(start, stop, dtype=np.int64)
            for byte in range(size):  # the step's varint, 7 bits a byte, low bits first
                more = 0x80 if byte < size - 1 else 0
                records[:, len(wall) + 1 + byte] = (steps >> (7 * byte)) & 0x7F | more
            slots = (len(head) + offsets)[:, None] + np.arange(4)
            records[:, slots.ravel()] = scalars[start - first:stop - first].view(
                np.uint8).reshape(stop - start, -1)
            batches.append(records)
        return batches


def _varint_runs(first: int, stop: int) -> list[tuple[int, int, int]]:
    """Steps ``first .. stop - 1`` as runs ``(start, stop, varint bytes)`` of one varint length
    (0 bytes for step 0, which protobuf leaves out)."""
    runs = []
    while first < stop:
        size = (first.bit_length() + 6) // 7
        end = min(stop, 1 << (7 * size))
        runs.append((first, end, size))
        first = end
    return runs


def _tensorboardx() -> tuple[Callable[[Any], int], Any, Any]:
    """tensorboardX's CRC-32C (native with the crc32c package) and event protos. Importing
    tensorboardX imports torch when it is installed (seconds, for support trainrun never
    uses), so torch is hidden for that."""
    extras.require("tensorboard", "metrics.tensorboard=true")
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        from tensorboardX.crc32c import crc32c

        # protoc's modules make their classes at import time, and tensorboardX ships no stubs.
        from tensorboardX.proto.event_pb2 import (
            Event,  # pyright: ignore[reportAttributeAccessIssue]
            SessionLog,  # pyright: ignore[reportAttributeAccessIssue]
        )
    finally:
        if hide:
            del sys.modules["torch"]
    return crc32c, Event, SessionLog


class WandbWriter:
    """A Weights & Biases run; ``mode="offline"`` writes it under the run dir with no network
    (``wandb sync <run dir>/wandb/offline-run-*`` uploads it later). A resumed run logs to the
    same W&B run (its id is kept in ``<run dir>/wandb-id``).

    ``wandb.log`` costs many fast steps a call, so train rows go to W&B at log points
    only (every ``every`` steps and the last); eval and timing rows all go.
    """

    def __init__(self, run_dir: Path, config: dict[str, Any], name: str,
                 mode: Literal["offline", "online"],
                 project: str, every: int = 1, total_steps: int = 0):
        extras.require("wandb", f"metrics.wandb={mode}")
        import wandb

        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow",
                              dir=str(run_dir), mode=mode, config=config,
                              settings=wandb.Settings(console="off", silent=True))
        self.every, self.total = every, total_steps

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        if split == "train" and step % self.every and step != self.total:
            return
        self.run.log({f"{split}/{name}": value for name, value in metrics.items()}, step=step)

    def write_table(self, table: Table, split: str = "train") -> None:
        for step, metrics in table.rows():
            self.write(step, metrics, split)

    def flush(self) -> None:
        """W&B sends and saves rows on its own schedule."""

    def close(self) -> None:
        self.run.finish()


# ---- the fan-out -----------------------------------------------------------------------------


class RunOutput:
    """Everything a run writes about its metrics: the writers, the console (``console.py``),
    timing windows.

    Rows come in windows (the loop's reads, or one at a time from a metrics stream on another
    thread): each goes to every writer, and log steps also to the console. A lock keeps rows
    from two threads whole.
    """

    def __init__(self, writers: list[Writer], console: Console,
                 log_every: int, total_steps: int, timing: JsonlWriter | None = None,
                 start_step: int = 0):
        self.writers = writers
        self.console = console
        self.log_every = log_every
        self.total = total_steps
        self.timing = timing
        self.lock = threading.Lock()
        self.last_log = (start_step, time.perf_counter())

    def write_table(self, table: Table, steps_per_s: float | None = None,
                    note: str = "") -> None:
        """A table of training steps to every writer, and its log steps to the console.
        steps_per_s: the rate its log lines show (the step compute of the window read; else
        the wall clock since the previous line). note: added to its log lines."""
        with self.lock:
            for writer in self.writers:
                writer.write_table(table)
            first_log = -(-table.first // self.log_every) * self.log_every
            log_steps = list(range(first_log, table.last + 1, self.log_every))
            if table.first <= self.total <= table.last and self.total not in log_steps:
                log_steps.append(self.total)
            for step in log_steps:
                self._log_line(step, table.row(step - table.first), steps_per_s, note)

    def _log_line(self, step: int, metrics: Mapping[str, float], rate: float | None = None,
                  note: str = "") -> None:
        now = time.perf_counter()
        if rate is None:
            rate = (step - self.last_log[0]) / max(now - self.last_log[1], 1e-9)
        self.last_log = (step, now)
        self.console.line(step, metrics, rate, note)

    def reset_rate(self, step: int) -> None:
        """The console's next rate counts from here (after a compile, which is not a step)."""
        with self.lock:
            self.last_log = (step, time.perf_counter())

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        """One row to every writer (eval rows: the console line is the caller's)."""
        with self.lock:
            for writer in self.writers:
                writer.write(step, metrics, split)

    def write_window(self, step: int, steps: int, step_s: float, examples_per_step: int) -> None:
        """One timing window (``timing.jsonl`` and the ``perf/`` charts): its last step, its
        step count and its device time per step."""
        perf = {"step_time_s": step_s, "steps_per_s": 1.0 / step_s if step_s else 0.0,
                "examples_per_s": examples_per_step / step_s if step_s else 0.0,
                "window_steps": float(steps)}
        with self.lock:
            if self.timing is not None:
                self.timing.write(step, perf)
            for writer in self.writers:
                if not isinstance(writer, JsonlWriter):
                    writer.write(step, perf, "perf")

    def message(self, text: str) -> None:
        with self.lock:
            self.console.message(text)

    def flush(self) -> None:
        """Rows written so far reach the files (before a checkpoint: they survive a kill)."""
        with self.lock:
            for writer in [*self.writers, self.timing]:
                if writer is not None:
                    writer.flush()

    def close(self) -> None:
        with self.lock:
            for writer in self.writers:
                writer.close()
            if self.timing is not None:
                self.timing.close()
            self.writers, self.timing = [], None
            self.console.close()


def build_output(run_dir: Path, console: Console, *, log_every: int,
                 total_steps: int, primary: bool, start_step: int = 0, tensorboard: bool = True,
                 wandb: Literal["off", "offline", "online"] = "off",
                 wandb_project: str = "trainrun",
                 config: dict[str, Any] | None = None, name: str = "run") -> RunOutput:
    """A run's ``RunOutput`` around its ``console`` (made earlier, for start-up messages).
    ``primary`` is process 0: the others write no files and print no lines (they would repeat
    process 0's)."""
    if not primary:
        silent = ConsoleLog(total_steps, 1, open(os.devnull, "w"))  # noqa: SIM115
        return RunOutput([], silent, log_every, total_steps, start_step=start_step)
    console.start_at(start_step)
    writers: list[Writer] = [JsonlWriter(run_dir / rundir.METRICS)]
    if tensorboard:
        writers.append(TensorBoardWriter(run_dir / TENSORBOARD_DIR, start_step))
    if wandb != "off":
        writers.append(WandbWriter(run_dir, config or {}, name, wandb, wandb_project,
                                   log_every, total_steps))
    return RunOutput(writers, console, log_every, total_steps,
                     JsonlWriter(run_dir / rundir.TIMING), start_step)
