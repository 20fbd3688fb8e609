"""TensorBoard event files: scalar events encoded and framed as TensorBoard reads them."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainrun import extras
from trainrun.reporting.table import Table

TENSORBOARD_DIR = "tensorboard"
# What tensorboardX's writers to s3:// and gs:// import, if installed, when it is imported.
TENSORBOARDX_BUCKET_CLIENTS = ("boto3", "google.cloud.storage")


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
    uses), so torch is hidden for that; in the ``trainrun`` program's own process, so are the
    clients of its S3 and GCS writers (a share of every ``trainrun train`` where they are
    installed: BENCHMARKS.md), which only a user's code in the process could want."""
    from trainrun.platform.process import command_owns_process

    extras.require("tensorboard", "metrics.tensorboard=true")
    hidden = ["torch", *(TENSORBOARDX_BUCKET_CLIENTS if command_owns_process() else ())]
    hidden = [name for name in hidden if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` -> ImportError
    try:
        from tensorboardX.crc32c import crc32c

        # protoc's modules make their classes at import time, and tensorboardX ships no stubs.
        from tensorboardX.proto.event_pb2 import (
            Event,  # pyright: ignore[reportAttributeAccessIssue]
            SessionLog,  # pyright: ignore[reportAttributeAccessIssue]
        )
    finally:
        for name in hidden:
            del sys.modules[name]
    return crc32c, Event, SessionLog
