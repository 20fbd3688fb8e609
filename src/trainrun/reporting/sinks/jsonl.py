"""``metrics.jsonl``: the metrics file every run writes, and its reader. The same writer
appends the records of a run's other JSONL files (``completions.jsonl``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.reporting.table import Table


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

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Any JSON object as one line (a sampled completion: texts beside numbers)."""
        self._add(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")

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
