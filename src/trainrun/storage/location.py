"""A location: a local path or a ``gs://``/``s3://`` one, made once where a path enters (the
commands, ``run()``, ``load()``, a config's paths) and handed down; every reader and writer of
a run's files calls its methods and never asks again which store it is on.

``location(path)`` is the one place that asks: a ``gs://``/``s3://`` URL becomes a
``remote.ObjectLocation`` (its URL checked, its store's client set up; each method one request
on whole objects, retried to ``storage.deadline_s``), anything else a ``LocalLocation`` (a
``pathlib.Path`` whose writes keep the file system's guarantees: a new file renamed into
place, never written through a link, ``atomic.py``). Both are a ``Location``: the shape of
``etils.epath.Path`` and universal-pathlib's ``UPath`` (a path joined with ``/``, whose store
comes with it), with trainrun's own requests behind the remote one (retries to a deadline,
one-line refusals, writes that create only), which neither library has.
"""

from __future__ import annotations

import datetime
import glob
import os
import shutil
from pathlib import Path, PosixPath, PurePosixPath
from typing import IO, Any, Protocol, Self

from trainrun.errors import UserError
from trainrun.storage import remote
from trainrun.storage.atomic import copy_file, create_whole, replace_file


class Location(Protocol):
    """What every location does, whichever store it is on (``LocalLocation``,
    ``remote.ObjectLocation``)."""

    @property
    def name(self) -> str: ...

    @property
    def parent(self) -> Self: ...

    @property
    def suffix(self) -> str: ...

    def __truediv__(self, key: str, /) -> Self: ...

    def with_name(self, name: str) -> Self: ...

    def absolute(self) -> Self: ...

    def read_bytes(self) -> bytes: ...

    def read_text(self, encoding: str | None = None) -> str:
        """The file as UTF-8 text (``UnicodeDecodeError`` as ``bytes.decode`` raises it)."""
        ...

    def write_bytes(self, data: bytes) -> int:
        """The file holds ``data``, whole: renamed into place locally (never through a link),
        one PUT remotely. A reader sees the old content or the new, never half."""
        ...

    def write_text(self, data: str) -> int: ...

    def exists(self) -> bool: ...

    def is_file(self) -> bool: ...

    def is_dir(self) -> bool:
        """A local folder, or a remote prefix that some object lies below."""
        ...

    def is_symlink(self) -> bool: ...

    def list_names(self) -> list[str]:
        """The names directly in a folder (a remote prefix's next parts), sorted; empty when
        there is nothing there."""
        ...

    def list_tree(self) -> dict[str, int]:
        """Every file below a folder: its name relative to it (``a/b``) and its size."""
        ...

    def content_checksums(self) -> dict[str, str]:
        """The checksums the store keeps of the files below (none locally)."""
        ...

    def identity(self) -> tuple[str, int, str]:
        """What changes when the file is written again: name, size and version or time."""
        ...

    def size(self) -> int | None:
        """The file's size in bytes; None when there is no such file."""
        ...

    def info(self) -> remote.ObjectInfo | None:
        """The file's size, version and the time of its last write (the store's clock); None
        when there is no such file."""
        ...

    def create(self, data: bytes) -> bool:
        """Write ``data`` only if nothing has that name; returns whether this call made it."""
        ...

    def require_bucket(self, doing: str = "reading") -> None:
        """One line when the bucket does not exist (nothing to check locally)."""
        ...

    def missing_line(self, what: str) -> str:
        """The line for nothing here: ``no {what} {location}`` (``StorageRefused`` for a bucket
        that does not exist)."""
        ...

    def real(self) -> PurePosixPath:
        """Where the location really is, to tell whether one lies in another: a local path
        with its links followed, an object as ``//scheme/bucket/key`` (apart from every local
        path)."""
        ...

    def upload(self, local: Path) -> None:
        """The local file ``local`` copied here, streamed; it appears whole or not at all."""
        ...

    def delete(self) -> None: ...

    def delete_tree(self) -> None:
        """A folder and everything below it (a remote prefix's objects)."""
        ...

    def move_tree(self, target: Self) -> None: ...

    def make_dirs(self) -> None: ...

    def open_read(self) -> IO[bytes]:
        """The file for reading a block at a time (ranged requests remotely)."""
        ...

    def read_range(self, start: int, end: int) -> bytes: ...

    def model_file(self, error: type[UserError] = UserError) -> Self: ...

    def matches(self) -> list[Self]:
        """The files this location, read as a pattern (``*``, ``?``, ``[...]``; ``**`` across
        folders), matches, sorted."""
        ...

    def epath(self) -> Any:
        """The location as ``etils.epath.Path``: how Orbax is handed it."""
        ...

    @property
    def renames(self) -> bool:
        """Whether a folder is renamed into place at once (a file system: a writer, Orbax
        among them, commits a folder by renaming it, and a run is moved aside the same way);
        object storage renames nothing: a folder is complete once an object written last
        (Orbax's commit file) lies in it, and a writer holds it by a lease object."""
        ...

    @property
    def local_path(self) -> Path | None:
        """The path a library that opens files by name itself is given (safetensors' memory
        map, a tokenizer's loader); None on object storage, read through these methods."""
        ...


def location(path: str | os.PathLike[str] | Location) -> Location:
    """``path`` as a location: a ``gs://``/``s3://`` URL as an ``ObjectLocation`` (its store's
    client set up first, a URL trainrun cannot take refused in one line: ``BadLocation``),
    anything else as a ``LocalLocation`` (``~`` expanded). A location is returned as it is."""
    if isinstance(path, LocalLocation | remote.ObjectLocation):
        return path
    text = str(path)
    if remote.is_remote(text):  # the one place a path is asked which store it is on
        remote.filesystem(text)  # the extra's hint, and the client configured, before any use
        return remote.ObjectLocation(text)
    return LocalLocation(os.fspath(path)).expanduser()  # type: ignore[arg-type]


def local(path: str | os.PathLike[str]) -> LocalLocation:
    """``path``, known to be on this machine's file system (a stage, a temporary folder), as a
    location."""
    return LocalLocation(os.fspath(path)).expanduser()


class LocalLocation(PosixPath):
    """A path on this machine's file system, as ``pathlib`` gives it, with the ``Location``
    operations: writes renamed into place, never through a link."""

    __slots__ = ()

    def read_text(self, encoding: str | None = None, errors: str | None = None) -> str:
        """The file's bytes decoded (UTF-8 unless told), line ends as they are."""
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")

    def write_bytes(self, data: Any) -> int:
        replace_file(self, bytes(data))
        return len(data)

    def write_text(self, data: str, encoding: str | None = None, errors: str | None = None,
                   newline: str | None = None) -> int:
        return self.write_bytes(data.encode(encoding or "utf-8", errors or "strict"))

    def list_names(self) -> list[str]:
        return sorted(p.name for p in self.iterdir()) if self.is_dir() else []

    def list_tree(self) -> dict[str, int]:
        """Links are followed as a read follows them."""
        return {str(p.relative_to(self)): p.stat().st_size
                for p in sorted(self.rglob("*")) if p.is_file()}

    def content_checksums(self) -> dict[str, str]:
        return {}  # a file system keeps none

    def identity(self) -> tuple[str, int, str]:
        stat = self.stat()
        return (str(self), stat.st_size, str(stat.st_mtime_ns))

    def size(self) -> int | None:
        return self.stat().st_size if self.is_file() else None

    def info(self) -> remote.ObjectInfo | None:
        if not self.is_file():
            return None
        stat = self.stat()
        when = datetime.datetime.fromtimestamp(stat.st_mtime, datetime.UTC)
        return remote.ObjectInfo(stat.st_size, str(stat.st_mtime_ns), when)

    def create(self, data: bytes) -> bool:
        return create_whole(self, data)

    def require_bucket(self, doing: str = "reading") -> None:
        """Nothing to check: a local path has no bucket."""

    def missing_line(self, what: str) -> str:
        return f"no {what} {self}"

    def real(self) -> PurePosixPath:
        return PurePosixPath(os.path.realpath(self))

    def upload(self, local: Path) -> None:
        copy_file(local, self)

    def delete(self) -> None:
        self.unlink(missing_ok=True)

    def delete_tree(self) -> None:
        if self.is_symlink():
            self.unlink()  # the link, never what it points to
        else:
            shutil.rmtree(self, ignore_errors=True)

    def move_tree(self, target: Self) -> None:
        """Renamed, its new parent made first."""
        target.parent.mkdir(parents=True, exist_ok=True)
        self.rename(target)

    def make_dirs(self) -> None:
        self.mkdir(parents=True, exist_ok=True)

    def open_read(self) -> IO[bytes]:
        return open(self, "rb")

    def read_range(self, start: int, end: int) -> bytes:
        with open(self, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def model_file(self, error: type[UserError] = UserError) -> Self:
        """This file of a model directory (its folder is the parent), to be read: returned as
        it is where its real path is inside the folder's real path or, for a Hugging Face hub
        snapshot (``<repo>/snapshots/<revision>``, whose files link to ``../../blobs/``),
        inside the repository's folder (the one holding ``snapshots`` and ``blobs``); a
        symbolic link anywhere else raises ``error`` on one line naming the link and its
        target."""
        folder = self.parent
        home = Path(os.path.realpath(folder))
        repos = [parent.parent for parent in (home, *home.parents)
                 if parent.name == "snapshots" and (parent.parent / "blobs").is_dir()]
        inside = repos[0] if repos else home
        real = Path(os.path.realpath(self))
        if not real.is_relative_to(inside):
            raise error(f"{self} is a symbolic link to {real}, outside {folder}: trainrun reads "
                        "a model directory's files only from inside it; put the file itself "
                        "there, or remove the link")
        return self

    def matches(self) -> list[Self]:
        found = (type(self)(p) for p in glob.glob(os.fspath(self), recursive=True))
        return sorted(p for p in found if p.is_file())

    def epath(self) -> Any:
        from etils import epath

        return epath.Path(os.fspath(self))

    @property
    def renames(self) -> bool:
        return True

    @property
    def local_path(self) -> Path:
        return self
