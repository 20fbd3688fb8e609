"""The folders one run writes, checked, claimed and locked before the run starts, and given back
as they were when it is refused."""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
from pathlib import Path
from typing import Any

from trainrun.errors import UserError
from trainrun.rundir.checkpoint_steps import committed_steps
from trainrun.rundir.layout import CHECKPOINTS, MARKER
from trainrun.rundir.lock import LOCK, RunLock
from trainrun.rundir.ownership import Found, inspect, write_marker
from trainrun.rundir.path_checks import (
    require_fits,
    require_no_links,
    require_real_steps,
    require_utf8,
)
from trainrun.storage import location
from trainrun.storage.location import Location


def move_aside(run_dir: Path) -> Path:
    """``runs/x`` -> ``runs/x.old-<UTC time>``: a fresh start never deletes a run. The path is
    made absolute first, so ``.`` (the working directory) moves too."""
    run_dir = Path(os.path.abspath(run_dir))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():  # two fresh starts within a second
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    run_dir.rename(target)
    return target


class RunDirectory:
    """The folders one run writes: its run directory and, when ``checkpoint.dir`` puts them
    elsewhere, its checkpoint directory.

    ``check`` refuses a folder that is not trainrun's (or is in use) before anything is
    written, and takes the lock of an existing one at once; ``claim``, once the run's inputs
    are known to be good, moves an old run aside (``--fresh``), creates and locks the folders
    and writes their markers; ``withdraw`` undoes that for a run refused before it started.
    ``release`` (or the process ending) frees the locks.
    """

    def __init__(self, run_dir: Path, ckpt_dir: Path | Location, fresh: bool = False):
        self.run_dir, self.fresh = location.local(run_dir), fresh
        self.local_ckpt = location.local(str(ckpt_dir))
        self.ckpt_dir: Location = self.local_ckpt  # a bucket's, for a run on object storage
        self.folders = [(self.run_dir, "--run-dir", "run")]
        if os.path.abspath(self.local_ckpt) != os.path.abspath(self.run_dir / CHECKPOINTS):
            self.folders.append((self.local_ckpt, "checkpoint.dir", "checkpoints"))
        self.locks: dict[Location, RunLock] = {}
        # What claim changed, for withdraw: folders it created, the entries an existing folder
        # held before it, and runs it moved aside (path, where to, whether it had a lock file).
        self.created: list[Path] = []
        self.held_before: dict[Path, set[str]] = {}
        self.moved: list[tuple[Path, Path, bool]] = []

    @property
    def display(self) -> Location:
        """The run directory as the user named it (a stage's bucket location)."""
        return self.run_dir

    def requests(self) -> contextlib.AbstractContextManager[Any]:
        """What the run's requests to object storage are held to while it runs (a local run
        directory: the store's defaults, for data read from a bucket too)."""
        return contextlib.nullcontext()

    def finish(self) -> None:
        """The run ended as it should: nothing left to do for a local directory."""

    def check(self) -> None:
        for path, flag, _ in self.folders:
            require_utf8(path, flag)
            require_fits(path, flag)
            require_no_links(path)
        if not self.fresh:  # --fresh moves the old steps aside instead
            require_real_steps(self.local_ckpt)
        for path, flag, role in self.folders:
            found = inspect(path, role)
            if found.kind == "foreign":
                raise UserError(_refusal(path, flag, role, found, self.fresh))
            lock = RunLock(path)
            if found.kind != "absent" and lock.acquire(create=False, what=_what(role)):
                self.locks[path] = lock

    def claim(self) -> list[str]:
        """Create, lock and mark the folders; returns the notices to print (a run moved aside,
        a folder taken over)."""
        notices = []
        existed = {path: inspect(path, role) for path, _, role in self.folders}
        for path, flag, role in self.folders:
            found = existed[path]
            if self.fresh and found.kind in ("marked", "legacy", "leftover"):
                lock = self.locks.pop(path, None) or RunLock(path)
                had_lock = lock.path.exists()
                lock.acquire(create=True, what=_what(role))
                try:
                    target = move_aside(path)
                finally:
                    lock.release()
                self.moved.append((path, target, had_lock))
                notices.append(f"moved the previous run aside: {path} -> {target}")
                found = existed[path] = Found("absent")
            before = {p.name for p in path.iterdir()} if path.is_dir() else None
            missing = [path, *(p for p in path.parents if not p.exists())]
            path.mkdir(parents=True, exist_ok=True)
            lock = self.locks.setdefault(path, RunLock(path))
            lock.acquire(create=True, what=_what(role))
            # Recorded once locked: withdraw never touches a folder another run holds.
            if before is None:
                self.created += missing
            else:
                self.held_before[path] = before
            lock.record_holder()
            now = inspect(path, role)  # again, under the lock: nobody wrote in between
            if now.kind == "foreign":
                raise UserError(_refusal(path, flag, role, now, self.fresh))
            if now.kind != "marked":
                write_marker(path, role)
            if found.kind == "legacy":
                notices.append(f"{path} was written by an earlier trainrun: marked it as "
                               f"trainrun's ({MARKER})")
        if self.local_ckpt.is_dir():  # Orbax writes into it after the claim
            self.held_before.setdefault(self.local_ckpt,
                                        {p.name for p in self.local_ckpt.iterdir()})
        if (existed[self.run_dir].kind in ("marked", "legacy", "leftover")
                and not committed_steps(self.ckpt_dir)):
            notices.append(f"taking over {self.run_dir}: it holds no checkpoint (its run "
                           "stopped or was refused before the first one); starting at step 0")
        return notices

    def withdraw(self) -> None:
        """Undo ``claim`` for a run refused before it started: remove the folders it created
        and what it added to existing ones, and move a run it moved aside back. Call while the
        locks are held (nobody else wrote there since the claim)."""
        self._remove_added()
        self._remove_created()
        self._move_back()
        self.created, self.held_before, self.moved = [], {}, []

    def _remove_added(self) -> None:
        """Remove what the claim added to folders that existed before it (never through a link)."""
        for path, names in self.held_before.items():
            for entry in path.iterdir() if path.is_dir() else ():
                if entry.name in names:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()

    def _remove_created(self) -> None:
        """Remove the claimed folders the claim created, then the parents it created if empty."""
        claimed = {path for path, _, _ in self.folders}
        for path in self.created:
            if path in claimed:
                shutil.rmtree(path, ignore_errors=True)
        for path in sorted(set(self.created) - claimed, key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):  # a parent: another run may have started in it
                path.rmdir()

    def _move_back(self) -> None:
        """Move each run the claim moved aside back to its place, with its lock as it was."""
        for path, target, had_lock in reversed(self.moved):
            if not path.exists():
                target.rename(path)
                if not had_lock:
                    (path / LOCK).unlink(missing_ok=True)

    def release(self) -> None:
        for lock in self.locks.values():
            lock.release()
        self.locks.clear()


def _what(role: str) -> str:
    return "run directory" if role == "run" else "checkpoint directory"


def _refusal(path: Path, flag: str, role: str, found: Found, fresh: bool) -> str:
    kind = "a trainrun run directory" if role == "run" else "a trainrun checkpoint directory"
    if fresh:
        return (f"--fresh moves only a trainrun run aside, and {flag} {path} is not {kind} "
                f"({found.why}); nothing was moved. Give {flag} a new or empty directory")
    return (f"{flag} {path} is not {kind} ({found.why}); trainrun writes only into a new or "
            f"empty directory or one of its own runs. Give {flag} a new or empty directory")
