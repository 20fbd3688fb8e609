"""Errors the CLI reports on one line: bad input the user fixes (exit 2), a write or a read the
file system refused, and the user's own code failing in a run (exit 1); ``path_refused``, the
line for a path the system would not take, and ``read_refused``, the error for a file it would
not read; and ``printable``, which keeps a name in such a line from driving the terminal."""

import errno


class UserError(Exception):
    """Base of every error caused by input (config, data, checkpoint, flags), not by a bug."""


class LineWarning(UserWarning):
    """A warning the CLI prints on one line (``warning: ...``), as it prints errors."""


class WriteFailed(Exception):
    """Not bad input: the file system refused a write (a full disk, a read-only folder). The
    run stops with one line naming the file and the last committed checkpoint; exit 1."""


class ReadFailed(Exception):
    """Not bad input: the system refused to read a file the input names (no permission, an I/O
    error). One line naming the file and the cause; exit 1."""


class UserCodeFailed(Exception):
    """Not trainrun's failure: code of the user's that a run calls (a reward, a callback, a
    model's functions, a data iterator) raised, ``SystemExit`` and ``KeyboardInterrupt``
    included. The run is recorded as failed, its last committed checkpoint kept, and stops with
    one line naming the function; exit 1. The exception raised is the ``__cause__``."""


class OutOfMemory(Exception):
    """Not bad input as such: an allocation failed mid-run (device or host). The run stops
    with one line naming what to lower and the last committed checkpoint; exit 1."""


def printable(text: str) -> str:
    """``text`` with each control character (C0, DEL, C1: escape sequences, bell, carriage
    return, newline) written as its ``\\x..`` escape, so a run name or path shown on a
    terminal shows as what it is instead of moving the cursor, recolouring or retitling it."""
    return "".join(char if char.isprintable() or char == " " else _escape(char)
                   for char in text)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


# errno -> what a path the user gave cannot be, and what to do: the input's fault, exit 2
_BAD_PATH = {
    errno.ENAMETOOLONG: ("is too long for the file system", "give a shorter path"),
    errno.ENOENT: ("does not exist", "give an existing path"),
    errno.ENOTDIR: ("runs through a file as if it were a folder", "give a path of folders"),
    errno.EISDIR: ("is a folder where a file is expected", "give a file"),
    errno.ELOOP: ("is a loop of symbolic links", "give a path that resolves"),
}
# errno -> what the system refused, and what to do: the environment's fault, exit 1
_REFUSED = {
    errno.EACCES: ("permission denied", "give this user access or another path"),
    errno.EPERM: ("operation not permitted", "give this user access or another path"),
    errno.EROFS: ("read-only file system", "give a writable place"),
    errno.ENOSPC: ("no space left on device", "free some space or give another place"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or give another place"),
}


def path_refused(err: OSError) -> tuple[str, int]:
    """The one line (without ``error: ``) and exit code for a path the system refused: a path
    that cannot be what the command was given (exit 2), or a system that would not read or
    write it (exit 1)."""
    name = printable(str(err.filename)) if err.filename is not None else "a path"
    if err.errno in _BAD_PATH:
        what, fix = _BAD_PATH[err.errno]
        return f"{name} {what}: {fix}", 2
    what, fix = _REFUSED.get(err.errno or 0, (
        (err.strerror or type(err).__name__).lower(), "check the path and the system"))
    return f"{what}: {name}; {fix}", 1


def read_refused(err: OSError) -> Exception:
    """What to raise for a file the system would not read: ``ReadFailed`` where the system
    refused (exit 1), ``UserError`` where the path cannot be what was given (exit 2)."""
    line, code = path_refused(err)
    return ReadFailed(line) if code == 1 else UserError(line)
