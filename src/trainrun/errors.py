"""Errors the CLI reports on one line: bad input the user fixes (exit 2), and a write the file
system refused (exit 1)."""


class UserError(Exception):
    """Base of every error caused by input (config, data, checkpoint, flags), not by a bug."""


class WriteFailed(Exception):
    """Not bad input: the file system refused a write (a full disk, a read-only folder). The
    run stops with one line naming the file and the last committed checkpoint; exit 1."""
