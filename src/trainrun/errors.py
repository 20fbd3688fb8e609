"""Errors the CLI reports on one line: bad input the user fixes (exit 2), and a write the file
system refused (exit 1); and ``printable``, which keeps a name in such a line from driving the
terminal."""


class UserError(Exception):
    """Base of every error caused by input (config, data, checkpoint, flags), not by a bug."""


class WriteFailed(Exception):
    """Not bad input: the file system refused a write (a full disk, a read-only folder). The
    run stops with one line naming the file and the last committed checkpoint; exit 1."""


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
