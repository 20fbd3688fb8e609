"""Paths refused up front, in one line, before anything is written: names the file system would
refuse, bytes that are not UTF-8, and links where trainrun writes its own files."""

from __future__ import annotations

import os
from pathlib import Path

from trainrun.errors import UserError
from trainrun.rundir.layout import RUN_FILES

NAME_MAX, PATH_MAX = 255, 4096  # bytes in a file name and in a path on Linux
INSIDE_MAX = 256  # bytes a run's own files add below its folder (a checkpoint's deepest file)


def require_fits(path: Path, flag: str) -> None:
    """A path whose file names, or whose length with the run's files below it, the file
    system would refuse, refused up front in one line instead of midway."""
    raw = os.fsencode(os.path.abspath(path))
    long = [part for part in raw.split(b"/") if len(part) > NAME_MAX]
    if long:
        raise UserError(f"{flag} has a folder name of {len(long[0])} bytes; a file name may "
                        f"have at most {NAME_MAX}: give a shorter one")
    if len(raw) + INSIDE_MAX > PATH_MAX:
        raise UserError(f"{flag} is {len(raw)} bytes long as an absolute path; with the files a "
                        f"run writes below it that passes the {PATH_MAX}-byte limit on a path: "
                        f"give one under {PATH_MAX - INSIDE_MAX} bytes")


def require_real_steps(ckpt_dir: Path) -> None:
    """A checkpoint step that is a symbolic link was not written by trainrun, and deleting it
    as an old step would fail on every later run: refused in one line naming it."""
    if not ckpt_dir.is_dir():
        return
    links = sorted(p for p in ckpt_dir.iterdir() if p.is_symlink())
    if links:
        raise UserError(f"{links[0]} is a symbolic link, not a checkpoint trainrun wrote; "
                        f"move it out of {ckpt_dir} (trainrun deletes old steps) and start again")


def require_no_links(folder: Path) -> None:
    """A run's own file that is a symbolic link was not made by trainrun, and appending to it
    or truncating it would change the file it points to: refused in one line naming it."""
    for name in RUN_FILES:
        path = folder / name
        if path.is_symlink():
            raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}), not a file "
                            f"trainrun wrote; trainrun writes only its own files in a run "
                            f"directory: remove the link (what it points to is left alone)")


def require_utf8(path: Path, flag: str) -> None:
    """Orbax and TensorStore take paths as UTF-8 text: refuse any other bytes up front."""
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{flag} {raw!r} is not valid UTF-8 (byte {raw[err.start]:#04x}); "
                        "checkpoints need a UTF-8 path: give one") from None
