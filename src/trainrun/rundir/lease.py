"""One writer per run directory on object storage: a lease, taken and renewed by conditional
writes.

A bucket has no ``flock``, and a job's processes may run on many machines. The run directory
holds numbered lease objects, ``trainrun.lease/00000001``, ``00000002``, ...; the newest names
the job that holds the run. Taking the lease is creating the next number with a write that
succeeds only if no object has that name (GCS ``ifGenerationMatch=0``, S3 ``If-None-Match:
*``: ``ObjectLocation.create``), so of two jobs that try at once exactly one wins.

The holder rewrites its object every quarter of the lease (``storage.lease_s``); the store stamps
each write with its own time. A lease whose object the store last wrote more than ``lease_s``
ago (measured on the store's clock, against an object written just then: no machine's clock is
compared with another's) belongs to a job that is gone, and the next job takes it by creating
the next number; so does one held by a process of this host that no longer exists. A job that
finds a newer number than its own when it renews has lost the run (it was cut off from the
store for longer than its lease) and stops. A job that ends writes ``released`` into its
object, so the next one need not wait.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import socket
from typing import Any

from trainrun.rundir.lock import RunDirLocked
from trainrun.storage import location, remote
from trainrun.storage.location import Location

LEASES = "trainrun.lease"  # the folder of lease objects in a run directory on object storage
DIGITS = 8


class LeaseLost(RunDirLocked):
    """Another job took the lease while this one could not renew it; the run stops."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _gone(record: dict[str, Any]) -> bool:
    """Whether the holder was a process of this host that no longer exists (killed): its lease
    need not run out."""
    if record.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        pass
    return False


class Lease:
    """The lease on the run directory ``url`` (on object storage)."""

    def __init__(self, url: Location, lease_s: float):
        self.url, self.lease_s = url, float(lease_s)
        self.folder = url / LEASES
        self.number: int | None = None
        self.since = _now()

    @property
    def held(self) -> bool:
        return self.number is not None

    def _object(self, number: int) -> Location:
        return self.folder / f"{number:0{DIGITS}d}"

    def _numbers(self) -> list[int]:
        return sorted(int(name) for name in self.folder.list_names()
                      if name.isdigit() and len(name) == DIGITS)

    def _record(self, released: bool = False) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": self.since, "renewed": _now(), "lease_s": self.lease_s,
                           "released": released}).encode() + b"\n"

    def _store_time(self) -> datetime.datetime | None:
        """The store's clock now: the time it stamps on an object written for the purpose."""
        probe = self.folder / f"clock-{secrets.token_hex(6)}"
        probe.write_bytes(b"")
        try:
            info = probe.info()
        finally:
            probe.delete()
        return info.updated if info is not None else None

    def acquire(self) -> None:
        """Take the lease, or raise ``RunDirLocked`` naming the job that holds it and when its
        lease runs out."""
        numbers = self._numbers()
        following = 1
        if numbers:
            self._refuse_if_live(numbers[-1])
            following = numbers[-1] + 1
        if not self._object(following).create(self._record()):
            raise RunDirLocked(f"run directory {self.url} was just taken by another job (it "
                               "created the next lease first); wait for that run to end, or "
                               "give another --run-dir")
        self.number = following
        for old in numbers:  # what is left of leases before this one: nobody reads them again
            with contextlib.suppress(remote.StorageRefused, FileNotFoundError):
                self._object(old).delete()

    def _refuse_if_live(self, number: int) -> None:
        """Refuse when lease ``number`` is live: not released and written within its length."""
        path = self._object(number)
        try:
            record = json.loads(path.read_bytes())
        except FileNotFoundError:
            return  # deleted by the job that created a newer one: it lists on the next try
        except ValueError:
            record = {}
        if not isinstance(record, dict) or record.get("released") or _gone(record):
            return
        info = path.info()
        now = self._store_time()
        if info is None or info.updated is None or now is None:
            return
        length = float(record.get("lease_s") or self.lease_s)
        age = (now - info.updated).total_seconds()
        if age < length:
            who = (f"pid {record.get('pid')} on host {record.get('host')}, since "
                   f"{record.get('since')}")
            raise RunDirLocked(
                f"run directory {self.url} is held by another job ({who}); its lease was "
                f"renewed {max(age, 0):.0f} s ago and runs out {length - age:.0f} s from now "
                f"if that job is gone (storage.lease_s={length:g}): wait for that run to end, "
                "or give another --run-dir")

    def renew(self) -> None:
        """Write this job's lease again; ``LeaseLost`` when a newer one exists."""
        assert self.number is not None
        if self._object(self.number + 1).info() is not None:
            number, self.number = self.number, None
            raise LeaseLost(
                f"run directory {self.url} was taken over by another job: this one could not "
                f"renew its lease (number {number}) within storage.lease_s={self.lease_s:g}; "
                "it stops without writing more")
        self._object(self.number).write_bytes(self._record())

    def release(self) -> None:
        """Mark the lease released (the next job takes it at once); best effort."""
        if self.number is None:
            return
        number, self.number = self.number, None
        with contextlib.suppress(Exception):
            if self._object(number + 1).info() is None:
                self._object(number).write_bytes(self._record(released=True))

    def remove(self) -> None:
        """Delete this job's lease object (a run refused before it started leaves nothing)."""
        if self.number is None:
            return
        number, self.number = self.number, None
        with contextlib.suppress(Exception):
            self._object(number).delete()


def job_gone(url: Location | str | os.PathLike[str]) -> bool:
    """Whether the job that last held the run at ``url`` is gone: its lease released, run out,
    or held by a dead process of this host (what ``trainrun runs`` says of a run whose status
    still reads running)."""
    url = location.location(url)  # a path given here enters here
    probe = Lease(url, 60.0)
    numbers = probe._numbers()
    if not numbers:
        return True
    try:
        probe._refuse_if_live(numbers[-1])
    except RunDirLocked:
        return False
    return True
