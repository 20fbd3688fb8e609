"""A ``.safetensors`` file on object storage (``gs://``, ``s3://``), read by byte ranges:
``safetensors.safe_open`` needs a local file, and a shard is never copied whole to this machine.

The format: an 8-byte little-endian header length ``N``, a JSON header of ``N`` bytes mapping
each tensor's name to its ``dtype``, ``shape`` and ``data_offsets`` ``[begin, end)`` (counted
from the end of the header; ``__metadata__`` holds strings), then the data, each tensor's
elements little-endian in row-major order. The header is read first (one request, two for a
long one) and every entry checked against the object's size; a tensor, or the rows of it a
device needs, is then one ranged request.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from trainrun.errors import UserError
from trainrun.storage.location import Location

FIRST_READ = 2**16  # bytes read at once from the start: the header of a shard, mostly
MAX_HEADER = 100 * 2**20  # the largest header safetensors itself reads


def _dtypes() -> dict[str, Any]:
    import ml_dtypes  # JAX's own dependency: bfloat16 and the 8-bit floats for NumPy

    return {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
            "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
            "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("<i8"),
            "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
            "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"),
            "U8": np.dtype("u1"), "BOOL": np.dtype("?")}


class Unreadable(UserError):
    """A file that is not whole safetensors; the message says what is wrong."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the file: its dtype (safetensors' name), shape, and where its bytes lie
    in the object (``start``, ``end``: absolute offsets)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Location) -> dict[str, Entry]:
    """Every tensor's entry in the safetensors object at ``path``, each checked: a known dtype,
    a shape of whole numbers, and a byte range of exactly its elements inside the object.
    ``Unreadable`` names what is wrong; ``FileNotFoundError`` when there is no such object."""
    size = path.size()
    if size is None:
        raise FileNotFoundError(f"no object {path}")
    header, data_start = _json_header(path, size)
    dtypes = _dtypes()
    entries: dict[str, Entry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries[str(name)] = _checked_entry(name, entry, dtypes, data_start, size)
    return entries


def _json_header(path: Location, size: int) -> tuple[dict[str, Any], int]:
    """The JSON object at the head of the ``size``-byte object at ``path``, and the offset where
    the tensors' bytes start (after the 8-byte length and the header)."""
    if size < 8:
        raise Unreadable(f"it holds {size} bytes, fewer than the 8 of a header length")
    first = path.read_range(0, min(size, FIRST_READ))
    length = int.from_bytes(first[:8], "little")
    if length > MAX_HEADER or 8 + length > size:
        raise Unreadable(f"its header length {length} does not fit its {size} bytes")
    blob = first[8:8 + length]
    if len(blob) < length:
        blob += path.read_range(len(first), 8 + length)
    try:
        header = json.loads(blob)
    except ValueError as err:
        raise Unreadable(f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise Unreadable("its header is not a JSON object")
    return header, 8 + length


def _checked_entry(name: str, entry: Any, dtypes: dict[str, np.dtype], data_start: int,
                   size: int) -> Entry:
    """Tensor ``name``'s header ``entry`` as an ``Entry``, once its dtype is known, its shape
    whole numbers and its byte range exactly its elements inside the ``size``-byte object."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise Unreadable(f"tensor {name!r} has no dtype, shape and data_offsets") from None
    if dtype not in dtypes:
        raise Unreadable(f"tensor {name!r} has dtype {dtype!r}, which trainrun does not "
                         "read")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
            and all(type(n) is int for n in (begin, end))):
        raise Unreadable(f"tensor {name!r} has shape {shape} and data_offsets "
                         f"{entry['data_offsets']}, not whole numbers")
    nbytes = math.prod(shape) * dtypes[dtype].itemsize
    if not 0 <= begin <= end or end - begin != nbytes or data_start + end > size:
        raise Unreadable(f"tensor {name!r} ({dtype} {shape}, {nbytes} bytes) has "
                         f"data_offsets [{begin}, {end}] outside the object's {size} bytes "
                         "or of another length")
    return Entry(dtype, tuple(shape), data_start + begin, data_start + end)


def read_tensor(path: Location, entry: Entry, index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The tensor ``entry`` describes (``index``: a part of it), in its own dtype. When
    ``index`` takes a run of rows of the first axis, only those rows are requested."""
    dtype = _dtypes()[entry.dtype]
    shape = entry.shape
    parts = tuple(index) if isinstance(index, tuple) else ()
    lo, hi, rest = 0, shape[0] if shape else 0, parts
    if shape and parts and isinstance(parts[0], slice):
        start, stop, step = parts[0].indices(shape[0])
        if step == 1:  # rows lo..hi are contiguous bytes: only they are read
            lo, hi, rest = start, max(start, stop), (slice(None), *parts[1:])
    row = math.prod(shape[1:]) * dtype.itemsize
    begin, end = ((entry.start + lo * row, entry.start + hi * row) if shape else
                  (entry.start, entry.end))
    data = path.read_range(begin, end) if end > begin else b""
    if len(data) != end - begin:
        raise Unreadable(f"it ends before the {end - begin} bytes of a tensor at byte {begin} "
                         "(changed while it was read?)")
    rows = np.frombuffer(data, dtype).reshape((hi - lo, *shape[1:]) if shape else ())
    return rows[rest] if rest else rows
