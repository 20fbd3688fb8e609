"""Record files, read as a stream: JSONL (one JSON object per line, gzipped or not) and Parquet.

JSONL is read line by line with Python's own ``json``, each line decoded as strict UTF-8, so a
bad record is named by its file and line and the others are still read. Parquet is read by
pyarrow one batch of rows at a time (only the columns asked for), so neither format is ever
held whole in memory. A file on object storage (``gs://``, ``s3://``) is streamed the same way,
through the storage layer's ranged reads: nothing of it is copied to disk.

A line ``json`` would crash on, or read into a value nothing after it can use, is a bad record
too: arrays and objects nested more than ``MAX_DEPTH`` deep (found by counting brackets before
``json`` recurses into them), an integer longer than Python converts from text, and a string
holding a lone UTF-16 surrogate (``"\\ud800"``: no text, so no tokenizer takes it). Arrow does
not check the UTF-8 of the strings a Parquet file holds when it reads them: a row whose strings
are not UTF-8 is named by its row and column.

Each record comes with where it is (``file:line``, ``file row N``); one that cannot be used comes
as a description of what is wrong with it in its place, and the caller's policy refuses or
skips it.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from trainrun.data.errors import DataError
from trainrun.storage import location

Location = location.Location  # a local path, or a gs:// or s3:// one

PARQUET_ROWS = 1024  # rows per read from a Parquet file
# Python's json recurses per level, within the interpreter's recursion limit (1000 frames by
# default); half of it leaves room for the frames below the reader and for what walks a record
# later (a template's tojson).
MAX_DEPTH = 500
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')  # a JSON string, escapes included
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate gets into a line
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


Located = tuple[str, dict[str, Any] | str]  # where; the record, or what is wrong with it


def record_format(path: Location) -> str:
    """``jsonl`` or ``parquet`` from a file's name; another suffix is a DataError."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        return "jsonl"
    raise DataError(f"data.paths: {str(path)!r} is neither JSONL (.jsonl, .jsonl.gz) nor "
                    "Parquet (.parquet); convert it, or name the record files alone")


def read_records(path: Location, columns: Sequence[str] = ()) -> Iterator[Located]:
    """The records of one file in order, each with where it is; a line that is not UTF-8, not
    JSON or not a JSON object comes as what is wrong with it. columns: Parquet reads only these
    (those the file has); JSONL records are whole."""
    if record_format(path) == "parquet":
        yield from _parquet(path, columns)
    else:
        yield from _jsonl(path)


@contextlib.contextmanager
def _opened(path: Location) -> Iterator[Iterable[bytes]]:
    """A JSONL file's bytes, decompressed when it is gzipped: read from disk, or streamed from
    object storage a block at a time (ranged requests)."""
    gzipped = path.name.lower().endswith(".gz")
    local: os.PathLike[str] | None = path.local_path  # typed for gzip.open's binary overload
    if local is not None:
        with gzip.open(local, "rb") if gzipped else open(local, "rb") as file:
            yield file
        return
    with path.open_read() as raw:
        if not gzipped:
            yield raw
            return
        with gzip.GzipFile(fileobj=raw) as file:
            yield file


def _jsonl(path: Location) -> Iterator[Located]:
    try:
        with _opened(path) as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue  # a blank line (the last one, often) is no record
                yield f"{path}:{number}", _jsonl_record(line)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"data.paths: {str(path)!r} is not a whole gzip file ({err}); "
                        "compress it again, or give it uncompressed") from None
    except OSError as err:
        raise DataError(f"data.paths: cannot read {str(path)!r} ({err.strerror or err}); "
                        "check the file and its permissions") from None


def _jsonl_record(line: bytes) -> dict[str, Any] | str:
    """The JSON object on ``line``, or what is wrong with it."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 (byte {err.start + 1})"
    if _depth(line) > MAX_DEPTH:
        return _TOO_DEEP
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno})"
    except RecursionError:  # deeper than the stack left here, though within the cap
        return _TOO_DEEP
    except ValueError:  # the one other refusal of json: an integer's digits
        return (f"an integer of more than {sys.get_int_max_str_digits()} "
                "digits, more than Python reads (write it as a string)")
    if not isinstance(value, dict):
        return f"{describe(value)}, not a JSON object"
    # a lone surrogate can only come from a \u escape: other lines are not walked
    surrogate = lone_surrogate(value) if _SURROGATE_ESCAPE.search(line) else None
    return value if surrogate is None else surrogate


def _parquet(path: Location, columns: Sequence[str]) -> Iterator[Located]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading .parquet files needs pyarrow, which is not installed: "
                        "pip install 'trainrun[records]'") from None
    import pyarrow as pa

    try:
        with contextlib.ExitStack() as stack:
            # on object storage, a seekable file of ranged reads: pyarrow reads the footer,
            # then only the wanted columns' chunks, never the whole object
            source = (path.local_path if path.local_path is not None
                      else stack.enter_context(path.open_read()))
            file = pq.ParquetFile(source)
            present = set(file.schema_arrow.names)
            wanted = [name for name in columns if name in present] or None
            row = 0
            for batch in file.iter_batches(batch_size=PARQUET_ROWS, columns=wanted):
                for value in _rows(batch):
                    row += 1
                    yield f"{path} row {row}", value
    except (pa.ArrowException, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.paths: cannot read {str(path)!r} as Parquet ({first}); check "
                        "that the file is whole") from None


def _rows(batch: Any) -> list[dict[str, Any] | str]:
    """A Parquet batch's rows; one whose strings are not UTF-8 as what is wrong with it."""
    try:
        return list(batch.to_pylist())
    except UnicodeDecodeError:  # Arrow leaves string columns unchecked: find the rows
        pass
    rows: list[dict[str, Any] | str] = []
    for index in range(batch.num_rows):
        try:
            rows.append(batch.slice(index, 1).to_pylist()[0])
        except UnicodeDecodeError:
            bad = [name for name, column in zip(batch.schema.names, batch.columns, strict=True)
                   if _undecodable(column, index)]
            rows.append(f"column {', '.join(map(repr, bad))} holds a string that is not UTF-8")
    return rows


def _undecodable(column: Any, index: int) -> bool:
    try:
        column[index].as_py()
    except UnicodeDecodeError:
        return True
    return False


_TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep (arrays and objects within each other)"


def _depth(line: bytes) -> int:
    """How deep arrays and objects nest in a JSON line, brackets inside strings not counted.
    Only a line with more brackets than the limit is looked into."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return 0
    code = np.frombuffer(_STRING.sub(b"", line), np.uint8)
    steps = (np.isin(code, (ord("["), ord("{"))).astype(np.int64)
             - np.isin(code, (ord("]"), ord("}"))))
    return int(np.cumsum(steps).max(initial=0))


def lone_surrogate(value: Any) -> str | None:
    """Where in ``value`` (a record's JSON value) a string or key holds a lone UTF-16 surrogate,
    as what is wrong with the record; None when no string does. Walked without recursion."""
    pending: deque[tuple[str, Any]] = deque([("", value)])
    while pending:
        where, item = pending.popleft()
        if isinstance(item, str):
            if not _is_text(item):
                return (f"field {where or 'value'} holds a lone UTF-16 surrogate "
                        f"({_first_surrogate(item)}: half a character, no text)")
        elif isinstance(item, dict):
            for key, inner in item.items():
                if not _is_text(key):
                    return (f"a key of {where or 'the record'} holds a lone UTF-16 surrogate "
                            f"({_first_surrogate(key)}: half a character, no text)")
                pending.append((f"{where}.{key}" if where else key, inner))
        elif isinstance(item, list):
            pending.extend((f"{where}[{i}]", inner) for i, inner in enumerate(item))
    return None


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_surrogate(text: str) -> str:
    code = next(ord(char) for char in text if 0xD800 <= ord(char) <= 0xDFFF)
    return f"\\u{code:04x}"


def describe(value: Any) -> str:
    """A value's JSON type, for a record's error."""
    names = {str: "a string", int: "a number", float: "a number", bool: "true/false",
             list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
