"""Record files, read as a stream: JSONL (one JSON object per line, gzipped or not) and Parquet.

JSONL is read line by line with Python's own ``json``, each line decoded as strict UTF-8, so a
bad record is named by its file and line and the others are still read. Parquet is read by
pyarrow one batch of rows at a time (only the columns asked for), so neither format is ever
held whole in memory.

Each record comes with where it is (``file:line``, ``file row N``); one that cannot be used comes
as a description of what is wrong with it in its place, and the caller's policy refuses or
skips it.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainrun.data.pipeline import DataError

PARQUET_ROWS = 1024  # rows per read from a Parquet file
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


Located = tuple[str, dict[str, Any] | str]  # where; the record, or what is wrong with it


def record_format(path: Path) -> str:
    """``jsonl`` or ``parquet`` from a file's name; another suffix is a DataError."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        return "jsonl"
    raise DataError(f"data.paths: {str(path)!r} is neither JSONL (.jsonl, .jsonl.gz) nor "
                    "Parquet (.parquet); convert it, or name the record files alone")


def read_records(path: Path, columns: Sequence[str] = ()) -> Iterator[Located]:
    """The records of one file in order, each with where it is; a line that is not UTF-8, not
    JSON or not a JSON object comes as what is wrong with it. columns: Parquet reads only these
    (those the file has); JSONL records are whole."""
    if record_format(path) == "parquet":
        yield from _parquet(path, columns)
    else:
        yield from _jsonl(path)


def _jsonl(path: Path) -> Iterator[Located]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue  # a blank line (the last one, often) is no record
                where = f"{path}:{number}"
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    yield where, f"not UTF-8 (byte {err.start + 1})"
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as err:
                    yield where, f"not valid JSON ({err.msg} at column {err.colno})"
                    continue
                if not isinstance(value, dict):
                    yield where, f"{describe(value)}, not a JSON object"
                    continue
                yield where, value
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise DataError(f"data.paths: {str(path)!r} is not a whole gzip file ({err}); "
                        "compress it again, or give it uncompressed") from None
    except OSError as err:
        raise DataError(f"data.paths: cannot read {str(path)!r} ({err.strerror or err}); "
                        "check the file and its permissions") from None


def _parquet(path: Path, columns: Sequence[str]) -> Iterator[Located]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading .parquet files needs pyarrow, which is not installed: "
                        "pip install 'trainrun[records]'") from None
    import pyarrow as pa

    try:
        file = pq.ParquetFile(path)
        present = set(file.schema_arrow.names)
        wanted = [name for name in columns if name in present] or None
        row = 0
        for batch in file.iter_batches(batch_size=PARQUET_ROWS, columns=wanted):
            for value in batch.to_pylist():
                row += 1
                yield f"{path} row {row}", value
    except (pa.ArrowException, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.paths: cannot read {str(path)!r} as Parquet ({first}); check "
                        "that the file is whole") from None


def describe(value: Any) -> str:
    """A value's JSON type, for a record's error."""
    names = {str: "a string", int: "a number", float: "a number", bool: "true/false",
             list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
