"""Arrays trainrun makes once and keeps on this machine's disk for later runs: tokenized records
(``data/record_rows.py``), preference pairs (``data/preference_rows.py``) and a preference run's
reference log-probabilities (``training/preference_data.py``).

A kept folder holds one file per split and array (``train.tokens.bin``: ``[rows, row_len]``,
row after row) and a ``manifest.json`` with each file's sha256, the rows of each split, their
dtypes, and what its maker records beside them. It is made whole or not at all: its maker
writes a staging folder beside it, which is renamed into place (the rename commits it).
Processes on one machine check a kept folder side by side (a shared lock) and make it one at a
time (an exclusive lock), so it is made once. Each file's bytes are checked against its sha256
as a run opens it, then mapped read-only: a folder that does not read back as written (changed
or cut short by a disk or a hand) is made anew, with a one-line notice the run prints. A cache
directory that refuses a write (full, read-only, not permitted) is one line naming it, the
cause and ``TRAINRUN_CACHE_DIR``, exit 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from trainrun.errors import WriteFailed

MANIFEST = "manifest.json"
SPLITS = ("train", "eval")

Splits = dict[str, dict[str, np.ndarray] | None]  # each split's arrays; None: it has no rows
T = TypeVar("T")


class Damaged(Exception):
    """Kept files that do not read back as they were written; the message says how."""


@dataclasses.dataclass
class RowFiles:
    """Appends rows to one file per split and array in the folder being made, hashing the bytes
    as they go out (so nothing is read back for it); ``manifest`` is what commits them."""

    folder: Path
    dtypes: dict[str, str]  # each array's, in the order its files are written
    row_len: int
    rows: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    digests: dict[str, Any] = dataclasses.field(default_factory=dict)

    def append(self, split: str, arrays: dict[str, np.ndarray]) -> None:
        """``arrays`` (each ``[rows, row_len]``) appended to ``split``'s files."""
        self.rows[split] += next(iter(arrays.values())).shape[0]
        for name, dtype in self.dtypes.items():
            data = np.ascontiguousarray(arrays[name], dtype).tobytes()
            file = f"{split}.{name}.bin"
            self.digests.setdefault(file, hashlib.sha256()).update(data)
            with open(self.folder / file, "ab") as out:
                out.write(data)

    def manifest(self, **recorded: Any) -> dict[str, Any]:
        """The manifest of the files written, with what the maker ``recorded`` beside them."""
        return {"row_len": self.row_len, "rows": self.rows, "dtypes": self.dtypes,
                "sha256": {file: digest.hexdigest() for file, digest in self.digests.items()},
                **recorded}


def kept(folder: Path, what: str, arrays: Sequence[str],
         read: Callable[[dict[str, Any], Splits], T],
         make: Callable[[Path], dict[str, Any]]) -> tuple[T, str | None]:
    """``read(manifest, splits)`` of the files kept in ``folder`` (each split's ``arrays``) and
    the notice of files found damaged and made anew (None when they were not); made first by
    ``make(staging)``, which writes the files into the staging folder and returns their
    manifest, when missing or damaged. ``what`` names the files in notices and refusals
    (``tokenized records``)."""
    refused: OSError | None = None
    try:
        return _kept_or_made(folder, what, arrays, read, make)
    except OSError as err:
        refused = err
    raise cache_refused(refused, folder.parent, what)  # here: no OSError as its context


def _kept_or_made(folder: Path, what: str, arrays: Sequence[str],
                  read: Callable[[dict[str, Any], Splits], T],
                  make: Callable[[Path], dict[str, Any]]) -> tuple[T, str | None]:
    """The files kept in ``folder`` when they check out; else made there first."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_file = folder.parent / f"{folder.name}.lock"
    with locked(lock_file, fcntl.LOCK_SH), contextlib.suppress(Damaged):
        found = open_kept(folder, arrays, read)
        if found is not None:
            return found, None
    with locked(lock_file, fcntl.LOCK_EX):  # one maker per machine
        notice = None
        try:  # again: another process may have made them meanwhile
            found = open_kept(folder, arrays, read)
        except Damaged as damage:
            notice = f"the {what} kept in {folder} were damaged ({damage}); making them anew"
            found = None
            if folder.is_symlink():  # not a folder this cache made: not followed, not removed
                raise WriteFailed(f"{folder} is a symbolic link where trainrun keeps {what}; "
                                  "remove the link") from None
            shutil.rmtree(folder)
        if found is None:
            _made(folder, make)
            try:
                found = open_kept(folder, arrays, read)
            except Damaged as damage:
                raise WriteFailed(f"the {what} written to {folder} do not read back ({damage}); "
                                  "check the disk, or point TRAINRUN_CACHE_DIR elsewhere") from None
            if found is None:
                raise WriteFailed(f"the {what} written to {folder} are gone; check what else "
                                  "removes files from TRAINRUN_CACHE_DIR")
    return found, notice


def _made(folder: Path, make: Callable[[Path], dict[str, Any]]) -> None:
    """``folder`` made by ``make`` in a staging folder beside it, with its manifest, then
    renamed into place (a folder a failed or killed maker leaves is never read)."""
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        manifest = make(staging)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def locked(path: Path, kind: int) -> Iterator[None]:
    """``path`` locked (``fcntl.LOCK_SH`` or ``LOCK_EX``) for the block. A shared lock takes
    a lock file that exists in a directory this process cannot write (files made by another
    user, say: they are checked all the same)."""
    try:
        lock = open(path, "a")  # noqa: SIM115 (closed below)
    except OSError:
        if kind != fcntl.LOCK_SH or not path.is_file():
            raise
        lock = open(path)  # noqa: SIM115 (closed below)
    with lock:
        fcntl.flock(lock, kind)
        yield


def cache_refused(err: OSError, root: Path, what: str) -> WriteFailed:
    """The one line for a cache directory the system would not write to: where, why, what to
    do."""
    cause = (err.strerror or type(err).__name__).lower()
    fix = ("free space there, or set TRAINRUN_CACHE_DIR to a directory with room"
           if err.errno in (errno.ENOSPC, errno.EDQUOT) else
           "make it writable, or set TRAINRUN_CACHE_DIR to a directory this user can write")
    return WriteFailed(f"cannot keep the {what} in {root}: {cause}; {fix}")


def open_kept(folder: Path, arrays: Sequence[str],
              read: Callable[[dict[str, Any], Splits], T]) -> T | None:
    """``read(manifest, splits)`` of the files kept in ``folder``: each split's ``arrays``,
    each file checked against its sha256; None when there is no such folder (never made);
    ``Damaged`` when it does not read back as written."""
    if not folder.exists():
        return None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        row_len, dtypes, digests = manifest["row_len"], manifest["dtypes"], manifest["sha256"]
        splits: Splits = {}
        for split, rows in manifest["rows"].items():
            splits[split] = None if not rows else {
                name: mapped(folder / f"{split}.{name}.bin", dtypes[name], rows, row_len,
                             digests[f"{split}.{name}.bin"])
                for name in arrays}
        return read(manifest, splits)
    except FileNotFoundError as err:
        raise Damaged(f"{Path(err.filename or '?').name} is missing") from None
    except OSError as err:
        raise Damaged(f"{Path(err.filename or '?').name}: {err.strerror or err}") from None
    except (ValueError, KeyError, TypeError) as err:
        raise Damaged(f"{MANIFEST} is not as written ({type(err).__name__}: {err})") from None


def mapped(file: Path, dtype: str, rows: int, row_len: int, sha256: str) -> np.ndarray:
    """``[rows, row_len]`` of ``file``, read-only through a memory map, once its bytes are
    checked against ``sha256`` (read, not mapped, for that: the pages stay out of the process).
    Batches read rows at random: the kernel is told so, or each row read would pull in its
    neighbours as well."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != rows * row_len * np.dtype(dtype).itemsize:
            raise Damaged(f"{file.name} holds {size} bytes, not {rows} rows of {row_len} "
                          f"{dtype}")
        if hashlib.file_digest(f, "sha256").hexdigest() != sha256:
            raise Damaged(f"{file.name} does not match its sha256")
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, dtype).reshape(rows, row_len)
