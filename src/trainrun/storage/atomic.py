"""Files trainrun writes, never through a symbolic link: the one way every writer of a run's
files, a report, a plot or an export creates them.

``replace_file`` writes the new content to a file it creates under a random temporary name
beside the target (``O_CREAT | O_EXCL | O_NOFOLLOW``: a name already taken, a link included,
is never opened) and renames it over the target. A rename replaces whatever entry is at the
target, a link included, and never writes through it: a ``report.html`` that is a link to a
file elsewhere becomes a file of its own, and the file elsewhere is left as it was. A reader
never sees half a file, and a write that fails (a full disk) leaves the old file and no
temporary one. ``create_new`` is the same creation for a file written bit by bit (a copy).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"  # what a killed or refused write leaves (rundir/write_failures.py)
# Creates a file that did not exist, never opening an existing name or following a link.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_new(path: Path) -> BinaryIO:
    """``path`` created, empty, for writing; ``FileExistsError`` when anything is already
    there, a symbolic link included (a dangling one too)."""
    return os.fdopen(os.open(path, NEW_FILE, 0o666), "wb")


def replace_file(path: Path, data: bytes | str) -> None:
    """``path`` holds ``data`` (text as UTF-8): written whole under a temporary name and
    renamed over ``path``, which, if it is a link, is replaced and not followed. An ``OSError``
    names ``path`` (not the temporary name)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    # A short temporary name: the target's own may already be as long as a name can be.
    tmp = path.with_name(f".trainrun-{secrets.token_hex(6)}{TMP_SUFFIX}")
    created = False
    try:
        with create_new(tmp) as f:
            created = True
            f.write(payload)
        os.replace(tmp, path)
    except BaseException as err:
        if created:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if isinstance(err, OSError):  # the temporary name means nothing to the reader
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def create_whole(path: Path, data: bytes) -> bool:
    """``path`` holds ``data`` if nothing had that name (a link included), written whole under
    a temporary name and linked into place; returns whether this call made it. Of several
    writers, exactly one's content stays, never half of it."""
    tmp = path.with_name(f".trainrun-{secrets.token_hex(6)}{TMP_SUFFIX}")
    try:
        with create_new(tmp) as f:
            f.write(data)
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        if not tmp.exists():
            raise
        return False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return True


def copy_file(source: Path, path: Path) -> None:
    """``path`` holds a copy of the file ``source``, streamed under a temporary name beside it
    and renamed over it: whole or not at all, never written through a link."""
    tmp = Path(path).with_name(f".trainrun-{secrets.token_hex(6)}{TMP_SUFFIX}")
    try:
        with open(source, "rb") as f, create_new(tmp) as out:
            shutil.copyfileobj(f, out)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
