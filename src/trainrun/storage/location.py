"""A location: a local path or a ``gs://``/``s3://`` one, and the operations every reader and
writer of a run's files goes through, whichever it is.

Local paths keep the file system's guarantees (a new file renamed into place, never written
through a link: ``atomic.py``); remote ones are whole objects (``remote.py``: one PUT each,
retried up to ``storage.deadline_s``). Code above ``rundir/`` reads and writes a run's files
through these functions and never calls ``open()`` or ``os.*`` on a location that may be
remote (``os.fspath`` of a ``gs://`` path is a string a local call would take as a folder
named ``gs:``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import IO, Any

from trainrun.errors import UserError
from trainrun.storage import remote
from trainrun.storage.atomic import replace_file

Location = Any  # pathlib.Path, or etils.epath.Path for gs:// and s3://
is_remote = remote.is_remote


def location(path: str | os.PathLike[str] | Any) -> Location:
    """``path`` as its store's path type (``remote.location``)."""
    return remote.location(path)


def join(path: Location, *names: str) -> Location:
    for name in names:
        path = path / name
    return path


def read_bytes(path: Location) -> bytes:
    return remote.read_bytes(path) if is_remote(path) else Path(path).read_bytes()


def read_text(path: Location) -> str:
    """The file as UTF-8 text (``UnicodeDecodeError`` as ``bytes.decode`` raises it)."""
    return read_bytes(path).decode("utf-8")


def write_bytes(path: Location, data: bytes) -> None:
    """``path`` holds ``data``, whole: renamed into place locally (never through a link), one
    PUT remotely. A reader sees the old content or the new, never half."""
    if is_remote(path):
        remote.write_bytes(path, data)
    else:
        replace_file(Path(path), data)


def write_text(path: Location, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def exists(path: Location) -> bool:
    return remote.exists(path) if is_remote(path) else Path(path).exists()


def is_file(path: Location) -> bool:
    if is_remote(path):
        return remote.stat(path) is not None
    return Path(path).is_file()


def is_dir(path: Location) -> bool:
    """A local folder, or a remote prefix that some object lies below."""
    return remote.is_dir(path) if is_remote(path) else Path(path).is_dir()


def list_names(path: Location) -> list[str]:
    """The names directly in a folder (a remote prefix's next parts), sorted; empty when there
    is nothing there."""
    if is_remote(path):
        return remote.list_names(path)
    local = Path(path)
    return sorted(p.name for p in local.iterdir()) if local.is_dir() else []


def list_tree(path: Location) -> dict[str, int]:
    """Every file below a folder (every object below a remote prefix): its name relative to
    ``path`` (``a/b``) and its size. Locally, links are followed as a read follows them."""
    if is_remote(path):
        return dict(sorted(remote.list_tree(path).items()))
    local = Path(path)
    return {str(p.relative_to(local)): p.stat().st_size
            for p in sorted(local.rglob("*")) if p.is_file()}


def require_bucket(path: Location, doing: str = "reading") -> None:
    """On object storage, one line when ``path``'s bucket does not exist (a command that
    finds nothing there says so, not that nothing is there); nothing to check locally."""
    if is_remote(path):
        remote.require_bucket(path, doing)


def delete(path: Location) -> None:
    if is_remote(path):
        remote.delete(path)
    else:
        Path(path).unlink(missing_ok=True)


def delete_tree(path: Location) -> None:
    """A folder and everything below it (a remote prefix's objects)."""
    if is_remote(path):
        remote.delete_tree(path)
    elif Path(path).is_symlink():
        Path(path).unlink()  # the link, never what it points to
    else:
        shutil.rmtree(path, ignore_errors=True)


def move_tree(path: Location, target: Location) -> None:
    """A folder to a new place: renamed locally (its parent made first); on object storage,
    which cannot rename, each object copied, then the originals deleted."""
    if is_remote(path):
        remote.copy_tree(path, target)
        remote.delete_tree(path)
    else:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(path).rename(target)


def make_dirs(path: Location) -> None:
    """A local folder and its parents; nothing to make on object storage (a prefix exists
    once an object lies below it)."""
    if not is_remote(path):
        Path(path).mkdir(parents=True, exist_ok=True)


def open_read(path: Location) -> IO[bytes]:
    """The file for reading a block at a time (ranged requests remotely)."""
    return remote.open_read(path) if is_remote(path) else open(path, "rb")


def model_file(file: Location, error: type[UserError] = UserError) -> Location:
    """``file`` of a model directory (its folder is ``file``'s parent), to be read: returned as
    given where its real path is inside the folder's real path or, for a Hugging Face hub
    snapshot (``<repo>/snapshots/<revision>``, whose files link to ``../../blobs/``), inside
    the repository's folder (the one holding ``snapshots`` and ``blobs``); a symbolic link
    anywhere else raises ``error`` on one line naming the link and its target. A location on
    object storage (no links there) is returned as is."""
    if is_remote(file):
        return file
    file = Path(file)
    folder = file.parent
    home = Path(os.path.realpath(folder))
    repos = [parent.parent for parent in (home, *home.parents)
             if parent.name == "snapshots" and (parent.parent / "blobs").is_dir()]
    inside = repos[0] if repos else home
    real = Path(os.path.realpath(file))
    if not real.is_relative_to(inside):
        raise error(f"{file} is a symbolic link to {real}, outside {folder}: trainrun reads a "
                    "model directory's files only from inside it; put the file itself there, "
                    "or remove the link")
    return file
