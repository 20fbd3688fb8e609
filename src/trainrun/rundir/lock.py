"""One writer per run directory: an OS lock held for the run's life.

``flock`` on ``<dir>/trainrun.lock``. The kernel releases it when the process ends however it
ends (``kill -9`` included), so a lock is never left stale and there is nothing to clean up. The
lock belongs to the open file, not the process: a second ``run()`` in the same process is
refused just like a second ``trainrun train``. The holder writes its pid and host into the file
for the refusal to name; the file's content is only that message, never the lock itself, and
it is emptied when the lock is released.

On a file system shared by several hosts, only process 0 of a run takes it (the others write no
run files). Linux's NFS client maps ``flock`` to a whole-file POSIX lock, which NFSv4 servers
honour across hosts.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from trainrun.errors import UserError
from trainrun.storage import location
from trainrun.storage.location import Location

LOCK = "trainrun.lock"


class RunDirLocked(UserError):
    """Another process is writing to the run directory; the CLI exits 2."""


class RunLock:
    """``flock`` on ``directory/trainrun.lock``; ``release`` (or the process ending) frees it."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK
        self.fd: int | None = None
        self.recorded = False

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self, *, create: bool, what: str = "run directory") -> bool:
        """Take the lock without waiting. ``create=False`` only locks an existing lock file (a
        check that writes nothing); returns whether the lock is now held. Raises
        ``RunDirLocked`` naming the holder when another process has it."""
        if self.fd is not None:
            return True
        # Never through a link: record_holder truncates the file (check() names a link first).
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:
            if create:
                raise
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise RunDirLocked(
                f"{what} {self.directory} is in use by {holder(self.path)}; wait for that run "
                "to end (or stop it), or give another --run-dir") from None
        self.fd = fd
        return True

    def record_holder(self) -> None:
        """Write who holds the lock (pid, host, since when) for a refused second writer."""
        assert self.fd is not None
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": datetime.datetime.now(datetime.UTC).isoformat(
                               timespec="seconds")}) + "\n"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        self.recorded = True

    def release(self) -> None:
        """Empties the holder's record (it names a live process only) and frees the lock."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                if self.recorded:
                    os.ftruncate(fd, 0)
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the file releases the lock


def holder(path: Path) -> str:
    """``trainrun (pid 123 on host h, since ...)`` from a lock file; what is known of it."""
    try:
        info = json.loads(path.read_text())
        return (f"another trainrun run (pid {int(info['pid'])} on host {info['host']}, "
                f"since {info['since']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another trainrun run (it has not recorded its pid yet)"


def is_locked(directory: Path) -> bool:
    """Whether some process holds ``directory``'s lock (checked by trying it; never waits)."""
    lock = RunLock(directory)
    try:
        held = lock.acquire(create=False)
    except RunDirLocked:
        return True
    except OSError:
        return False
    if held:
        lock.release()
    return False


def refuse_joining(run_dir: Location | str | os.PathLike[str]) -> None:
    """Before a process joins a multi-process job: refuse, on one line, when the run directory
    is held, since its job is running and a process joining that job's coordinator under an id
    the job already has would stop it (``platform/coordinator.py``)."""
    run_dir = location.location(run_dir)  # a path given here enters here
    directory = run_dir.local_path
    if directory is not None and is_locked(directory):  # a bucket's run: its lease, at claim
        raise RunDirLocked(
            f"run directory {directory} is in use by {holder(directory / LOCK)}: its job is "
            "running, and joining that job's coordinator as a process it already has would "
            "stop it; wait for that run to end, or give another --run-dir")
