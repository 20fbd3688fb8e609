"""A run directory on object storage (``--run-dir gs://bucket/runs/x``, ``s3://...``).

    <url>/trainrun.json, config.yaml, provenance.json, status.json, summary.json,
          metrics.jsonl, timing.jsonl, tensorboard/     the run's files, uploaded from a stage
          checkpoints/<step>/...                         written there by Orbax and TensorStore
          trainrun.lease/<n>                             who holds the run (``lease.py``)

Checkpoints go straight to the bucket: each step is committed by Orbax's commit file, written
last, so a kill mid-upload leaves a step without one, never read and removed at the next start.
The run's other files are appended to line by line, which objects cannot be: they are written
in a local stage (``$TRAINRUN_CACHE_DIR/remote-runs/<digest of the url>``, made anew from the
bucket at each start, since the bucket is what counts) and uploaded whole by ``RunMirror``
every ``storage.sync_every_s``, after each checkpoint starts, and at the end. The same thread
renews the lease. A failure it meets (the store gone past ``storage.deadline_s``, the lease
lost) stops the run at the next call boundary (``training/storage_hook.py``).

``--fresh`` is refused here: a bucket cannot rename a run aside, and trainrun does not delete
one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from trainrun.errors import UserError, WriteFailed
from trainrun.platform.user_cache import cache_dir
from trainrun.rundir.checkpoint_steps import committed_steps
from trainrun.rundir.layout import CHECKPOINTS, FORMAT, MARKER
from trainrun.rundir.lease import LEASES, Lease, LeaseLost
from trainrun.rundir.lock import LOCK, RunLock
from trainrun.rundir.ownership import write_marker
from trainrun.rundir.run_directory import RunDirectory
from trainrun.storage import remote
from trainrun.storage.atomic import TMP_SUFFIX
from trainrun.storage.location import Location

STAGE = "remote-runs"


class RunStopped(WriteFailed):
    """A run on object storage stopped: its store did not answer past storage.deadline_s, or
    another job took its lease. One line, exit 1; ``step`` is where a resume starts."""

    step: int | None = None  # the cache directory's folder of stages


def stage_of(url: Location) -> Path:
    """The local stage of the run at ``url``: one per location, in the user's cache."""
    digest = hashlib.sha256(str(url).encode()).hexdigest()[:24]
    return cache_dir() / STAGE / digest


class RunMirror:
    """Uploads the stage's changed files to the bucket and renews the lease, in a thread of
    its own; ``failure`` holds the first error that thread met (the run stops on it)."""

    def __init__(self, stage: Path, url: Location, lease: Lease, sync_every_s: float):
        self.stage, self.url, self.lease = stage, url, lease
        self.sync_every_s = sync_every_s
        self.renew_every_s = lease.lease_s / 4
        self.uploaded: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) sent
        self.failure: Exception | None = None
        self._stop = threading.Event()
        self._sync_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def known(self) -> None:
        """What the stage holds now is what the bucket holds (just downloaded)."""
        self.uploaded = self._files()

    def _files(self) -> dict[str, tuple[int, int]]:
        found = {}
        for path in sorted(self.stage.rglob("*")):
            if path.is_symlink() or not path.is_file():
                continue
            name = path.relative_to(self.stage).as_posix()
            if name == LOCK or name.endswith(TMP_SUFFIX) or name.startswith(CHECKPOINTS + "/"):
                continue
            stat = path.stat()
            found[name] = (stat.st_size, stat.st_mtime_ns)
        return found

    def sync(self) -> None:
        """Upload every file of the stage that changed since it was last uploaded, the status
        last (a reader that sees it finished finds the summary there)."""
        with self._sync_lock:
            files = self._files()
            changed = [name for name, key in files.items() if self.uploaded.get(name) != key]
            changed.sort(key=lambda name: name == "status.json")
            for name in changed:
                (self.url / name).upload(self.stage / name)
                self.uploaded[name] = files[name]

    def sync_before_save(self, last_committed: int | None) -> None:
        """``sync`` on the run's thread, before a checkpoint: a failure is the run's stop."""
        try:
            self.sync()
        except Exception as err:
            if self.failure is None:
                self.failure = err
            stop = self.stopped(last_committed)
            raise (stop if stop is not None else err) from err

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="trainrun-mirror", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        next_sync = next_renewal = time.monotonic()
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_renewal:
                    self.lease.renew()
                    next_renewal = now + self.renew_every_s
                if now >= next_sync:
                    self.sync()
                    next_sync = time.monotonic() + self.sync_every_s
            except Exception as err:
                self.failure = err
                return
            wait = min(next_sync, next_renewal) - time.monotonic()
            self._stop.wait(max(wait, 0.05))  # a stop ends the wait

    def stopped(self, last_committed: int | None) -> Exception | None:
        """The error the run stops on, once the mirror failed: its line says where a resume
        starts (``step``); None while all is well."""
        failure = self.failure
        if failure is None:
            return None
        where = (f"the last committed checkpoint is step {last_committed}" if last_committed
                 is not None else "no checkpoint was committed")
        if isinstance(failure, LeaseLost):
            line = f"{failure}; {where}"
        else:
            line = (f"{failure}; {where} (the same command resumes from it once the store "
                    "answers)")
        stop = RunStopped(line)
        stop.step = last_committed
        return stop

    def stop(self, wait: bool = True) -> None:
        """End the thread; ``wait=False`` leaves it (a daemon) to a request the store never
        answers."""
        self._stop.set()
        if self._thread is not None:
            if wait:
                self._thread.join()
            self._thread = None


class RemoteRunDirectory(RunDirectory):
    """``RunDirectory`` for a run on object storage: the checks and the claim read and write
    the bucket, the run's files are written in the stage (``run_dir``), checkpoints in
    ``ckpt_dir`` on the bucket."""

    def __init__(self, url: Location, ckpt_dir: Location, fresh: bool, *, lease_s: float,
                 sync_every_s: float, deadline_s: float):
        self.url = url
        self.deadline_s = deadline_s
        stage = stage_of(url)
        super().__init__(stage, stage / CHECKPOINTS, fresh)
        self.ckpt_dir = ckpt_dir
        self.folders = [(self.run_dir, "--run-dir", "run")]
        self.lease = Lease(url, lease_s)
        self.mirror = RunMirror(stage, url, self.lease, sync_every_s)
        self.stage_lock = RunLock(stage)
        self.existed = False  # the bucket held this run before this start
        self.claimed = False  # claim wrote in the bucket (a location it found empty or its own)

    @property
    def display(self) -> Location:
        return self.url

    def requests(self) -> contextlib.AbstractContextManager[Any]:
        """Every request of the run, in any thread, given up after ``storage.deadline_s``."""
        return remote.deadline(self.deadline_s)

    def check(self) -> None:
        if self.fresh:
            raise UserError(f"--fresh moves a run aside, and object storage cannot rename: "
                            f"give a new --run-dir instead of {self.url} (trainrun deletes no "
                            "run)")
        if str(self.ckpt_dir).rstrip("/") != str(self.url / CHECKPOINTS):
            raise UserError(f"checkpoint.dir {self.ckpt_dir} with --run-dir {self.url}: a run "
                            "on object storage keeps its checkpoints in its own checkpoints/; "
                            "leave checkpoint.dir unset")
        self.url.require_bucket("writing")
        names = set(self.url.list_names()) - {LEASES}  # a lease alone: a run's start
        if names and MARKER not in names:
            shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
            raise UserError(f"--run-dir {self.url} is not a trainrun run directory (it holds "
                            f"{shown} and no {MARKER}); trainrun writes only into a new or "
                            "empty location or one of its own runs. Give --run-dir a new one")
        if names:
            self._check_marker()
        self.existed = bool(names)
        self.lease.acquire()
        self.locks[self.url] = self.stage_lock  # this process holds the run
        self._stage()

    def _check_marker(self) -> None:
        try:
            marker = json.loads((self.url / MARKER).read_bytes())
        except ValueError:
            marker = None
        if not isinstance(marker, dict) or not isinstance(marker.get("format"), int):
            raise UserError(f"--run-dir {self.url}: its {MARKER} cannot be read; give "
                            "another --run-dir")
        if marker["format"] > FORMAT:
            raise UserError(f"{self.url} was written by a newer trainrun (run directory format "
                            f"{marker['format']}; this one reads {FORMAT}); use that version, "
                            "or give another directory")

    def _stage(self) -> None:
        """A new stage holding the run's files as the bucket has them."""
        stage = self.run_dir
        if stage.is_symlink():
            stage.unlink()
        shutil.rmtree(stage, ignore_errors=True)  # trainrun's own, made again from the bucket
        stage.mkdir(parents=True)
        self.stage_lock.acquire(create=True)
        for name in self.url.list_tree() if self.existed else {}:
            if name.split("/", 1)[0] in (CHECKPOINTS, LEASES):
                continue
            target = stage / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((self.url / name).read_bytes())
        self.mirror.known()

    def claim(self) -> list[str]:
        notices = []
        if not (self.run_dir / MARKER).is_file():
            write_marker(self.run_dir, "run")
        self.claimed = True
        self.mirror.sync()  # the marker first: the location is a trainrun run from now on
        if self.existed and not committed_steps(self.ckpt_dir):
            notices.append(f"taking over {self.url}: it holds no checkpoint (its run stopped "
                           "or was refused before the first one); starting at step 0")
        self.mirror.start()
        return notices

    def withdraw(self) -> None:
        """A run refused before it started: what it wrote in the bucket goes (everything below
        a location it found empty and claimed, under its lease; nothing else, ever)."""
        self.mirror.stop()
        if self.claimed and not self.existed:
            with contextlib.suppress(Exception):
                for name in self.url.list_tree():
                    if name.split("/", 1)[0] != LEASES:
                        (self.url / name).delete()
        self.lease.remove()

    def finish(self) -> None:
        """The run ended as it should: every file uploaded, or the error that prevented it."""
        self.mirror.stop()
        if self.mirror.failure is not None:
            raise self.mirror.failure
        self.mirror.sync()

    def release(self) -> None:
        """Best effort at the very end, however the run ended: the files (a failure's status)
        uploaded, then the lease released."""
        lost = isinstance(self.mirror.failure, remote.StorageUnavailable)
        self.mirror.stop(wait=not lost)
        # A store that stopped answering is not asked again: the lease left to run out says
        # the job is gone (``trainrun runs`` reads it so), and the stage holds the status.
        if self.lease.held and not lost:
            with contextlib.suppress(Exception):
                self.mirror.sync()
            self.lease.release()
        self.stage_lock.release()
        self.locks.clear()
