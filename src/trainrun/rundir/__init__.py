"""The run directory: what a run leaves on disk, and where.

    <run dir>/trainrun.json     the marker: this folder is a trainrun run (format version)
              trainrun.lock     held (flock) by the one process writing the run
              config.yaml       the resolved config
              provenance.json   what the run was measured on
              metrics.jsonl     one line per training step (and per eval)
              summary.json      written at the end: final loss, timing, throughput
              timing.jsonl      one line per timing window: device time per step
              status.json       running | finished | preempted | failed, and by which process
              tensorboard/      TensorBoard event files
              checkpoints/      Orbax step directories (see checkpoint.py)

A run directory with a committed checkpoint resumes from it; ``--fresh`` moves the run aside.

trainrun writes only into a folder it can tell is its own: one it creates (the marker is its
first file, before ``checkpoints/``), an empty one, or one holding the marker. A run directory
written before the marker existed is recognised by the ``status.json`` or ``provenance.json``
trainrun wrote beside its ``config.yaml`` (keys no user file is likely to share) and is marked
when next trained. Any other folder is refused before anything is written, renamed or trimmed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import yaml

from trainrun.config import RunConfig, dump_yaml
from trainrun.errors import UserError
from trainrun.rundir import location
from trainrun.rundir.lock import LOCK, RunLock

MARKER = "trainrun.json"
FORMAT = 1  # the run directory layout this trainrun reads and writes
CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TIMING = "timing.jsonl"
STATUS = "status.json"
STATUSES = ("running", "finished", "preempted", "failed")


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / config.name


def write_text(path: Path, text: str) -> None:
    """Written whole (``location.write_bytes``): locally to a new temporary name and renamed
    (``atomic.replace_file``), so a reader never sees half a file, a write that fails (a full
    disk) leaves the old file and no temporary one, and neither the file nor a name placed in
    advance is written through as a link; on object storage, one PUT."""
    location.write_text(path, text)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=2) + "\n")


class DamagedFile(UserError):
    """A file trainrun wrote in a run directory that no longer reads; one line, exit 2."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} is damaged ({why}); trainrun wrote it and it no longer "
                         "reads: restore it from a copy, or move the run aside")
        self.path = path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object trainrun wrote; ``DamagedFile`` when the file is not one any more."""
    return _object(path, json.loads, "JSON")


def read_yaml(path: Path) -> dict[str, Any]:
    """A run's ``config.yaml`` as a mapping; ``DamagedFile`` when it is not one any more."""
    return _object(path, yaml.safe_load, "YAML")


def _object(path: Path, parse: Any, kind: str) -> dict[str, Any]:
    raw = location.read_bytes(path)
    try:
        value = parse(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        why = f"not UTF-8 text: byte {raw[err.start]:#04x} at offset {err.start}"
    except (ValueError, yaml.YAMLError):
        why = f"not {kind}"
    else:
        if isinstance(value, dict):
            return value
        why = f"not a {kind} mapping"
    raise DamagedFile(path, why)


def write_marker(folder: Path, role: str) -> None:
    """The marker that says ``folder`` is trainrun's: a run, or a checkpoint directory."""
    write_json(folder / MARKER, {
        "format": FORMAT, "holds": role,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})


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


def start(run_dir: Path, config: RunConfig, provenance: dict[str, Any], step: int) -> None:
    """Write the run's files for a run (re)starting at ``step``: the config (``steps`` may have
    grown), this process's provenance, and ``metrics.jsonl`` cut back to ``step`` so that each
    step is in it once."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / CONFIG, dump_yaml(config))
    write_json(run_dir / PROVENANCE, provenance)
    truncate_metrics(run_dir / METRICS, step)
    truncate_metrics(run_dir / TIMING, step)


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the lines of steps after ``step`` (written before a kill, recomputed on resume);
    returns how many were dropped. Rewritten to a temporary name and renamed, like JSON."""
    if not path.exists():
        return 0
    lines = path.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _line_step(line) <= step]
    if len(kept) == len(lines):
        return 0
    write_text(path, b"".join(kept).decode("utf-8"))
    return len(lines) - len(kept)


def _line_step(line: bytes) -> int:
    """A record's step; a line that is no record (torn by a kill, or garbled bytes) is past
    every step, so it is dropped."""
    try:
        return int(json.loads(line.decode("utf-8"))["step"])
    except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        return 1 << 62


def finished_message(run_dir: Path, step: int, steps: int) -> str:
    over = ("give a new --run-dir (a bucket cannot move a run aside)" if location.is_remote(run_dir)
            else "pass --fresh (moves this run aside)")
    return (f"{run_dir} is finished: its last checkpoint is at step {step} (config steps="
            f"{steps}). To train it further pass steps=N with N > {step}; to start over {over}.")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SUMMARY
    return read_json(path) if location.exists(path) else {}


def write_status(run_dir: Path, status: str, step: int | None = None,
                 reason: str | None = None) -> None:
    """Record where a run stands (``trainrun runs`` reads it): one of ``STATUSES``, the step if
    known, and the process that wrote it (so a run whose process died shows as failed); a
    failed run also says why."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    write_json(run_dir / STATUS, {
        "status": status,
        "step": step,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **({"reason": reason} if reason else {}),
    })


def mark_failed(run_dir: Path, reason: str, ckpt_dir: Path | None = None,
                pid: int | None = None, step: int | None = None) -> None:
    """A run this process started that raised is ``failed`` for ``trainrun runs``, with why (a
    refusal before it started leaves the directory's status as it was), at the step of its last
    committed checkpoint in ``ckpt_dir`` (where a resume starts). pid: the process that ran it
    (default this one; ``trainrun launch`` records for the processes it started). Best effort:
    the disk may be the reason."""
    with contextlib.suppress(OSError):
        status = read_status(run_dir) if run_dir.exists() else {}
        # a launched process that died reads as failed ("process gone") to its launcher
        recorded = ("running",) if pid is None else ("running", "failed")
        if (status.get("status") not in recorded
                or status.get("pid") != (os.getpid() if pid is None else pid)):
            return
        committed = committed_steps(ckpt_dir) if ckpt_dir is not None else []
        if committed or step is not None:
            status["step"] = step if step is not None else committed[-1]
        try:
            write_status(run_dir, "failed", status.get("step"), reason)
        except OSError:  # a full disk has no room for a new file: rewrite the old one in place
            text = json.dumps({**status, "status": "failed", "reason": reason}, indent=2) + "\n"
            # never through a link: status.json is trainrun's own file, not one it points to
            with os.fdopen(os.open(run_dir / STATUS, os.O_RDWR | os.O_NOFOLLOW), "r+b") as f:
                f.write(text.encode())
                f.truncate()


def record_stopped(run_dir: Path, ckpt_dir: Path, reason: str, pid: int) -> str:
    """A run whose processes were stopped from outside (``trainrun launch`` saw it): marked
    ``failed`` with ``reason`` and where a resume starts, which the returned line says too."""
    steps = committed_steps(ckpt_dir)
    line = reason + (f"; the last committed checkpoint is step {steps[-1]} (the same command "
                     "resumes from it)" if steps else "; no checkpoint was committed")
    mark_failed(run_dir, line, ckpt_dir, pid=pid)
    return line


def read_status(run_dir: Path) -> dict[str, Any]:
    """The recorded status; ``running`` whose process is gone from this host reads as
    ``failed``. A run without a status file (written before there were any) reads as
    ``finished`` if it has a summary, else ``unknown``."""
    path = run_dir / STATUS
    if not location.exists(path):
        return {"status": "finished" if location.exists(run_dir / SUMMARY) else "unknown"}
    try:
        status = read_json(path)
    except DamagedFile:
        return {"status": "unknown"}
    if status.get("status") == "running" and location.is_remote(run_dir):
        from trainrun.rundir.lease import job_gone  # the lease, on object storage

        if job_gone(run_dir):
            return {**status, "status": "failed", "note": "its job stopped renewing its lease"}
        return status
    if status.get("status") == "running" and status.get("host") == socket.gethostname():
        try:
            os.kill(int(status["pid"]), 0)
        except ProcessLookupError:
            status = {**status, "status": "failed", "note": "process gone"}
        except (PermissionError, KeyError, TypeError, ValueError):
            pass
    return status


# ---- whose folder is it ----------------------------------------------------------------------

CHECKPOINTS = "checkpoints"  # the checkpoint folder in a run directory, unless checkpoint.dir
ORBAX_TMP = ".orbax-checkpoint-tmp"  # Orbax's suffix for a step still being written


@dataclasses.dataclass(frozen=True)
class Found:
    """What a folder holds, for a run directory (``role`` "run") or a checkpoint directory kept
    elsewhere ("checkpoints"): absent | empty | marked (its marker says trainrun's) | legacy
    (trainrun's, from before the marker) | leftover (nothing but an empty ``checkpoints/`` or
    a lock file: a run that died before its marker) | foreign (``why`` says what is there)."""

    kind: str
    why: str = ""


COMMIT_FILE = "commit_success.txt"  # Orbax's mark of a committed step on object storage


def committed_steps(ckpt_dir: Path) -> list[int]:
    """The committed steps of a checkpoint directory, oldest first: locally the step folders
    (Orbax renames a step to its number only once every file is written); on object storage,
    which has no rename, the step folders holding Orbax's commit file (written last)."""
    if location.is_remote(ckpt_dir):
        return sorted(int(name) for name in location.list_names(ckpt_dir)
                      if name.isdigit() and location.exists(ckpt_dir / name / COMMIT_FILE))
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit() and p.is_dir())


def uncommitted_steps(ckpt_dir: Path) -> list[str]:
    """On object storage, the step folders without Orbax's commit file: saves cut short (or
    still being written), never read as checkpoints."""
    return [name for name in location.list_names(ckpt_dir)
            if name.isdigit() and not location.exists(ckpt_dir / name / COMMIT_FILE)]


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


# The files a run writes at its top: none may be a link, which a write would follow out of it.
RUN_FILES = (MARKER, LOCK, CONFIG, PROVENANCE, METRICS, SUMMARY, TIMING, STATUS)


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


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _by_trainrun(path: Path) -> bool:
    """A run directory from before the marker: trainrun's own status or provenance file."""
    status, prov = _json(path / STATUS), _json(path / PROVENANCE)
    return ((isinstance(status, dict) and status.get("status") in STATUSES
             and {"pid", "host", "updated"} <= status.keys())
            or (isinstance(prov, dict) and {"trainrun", "jax", "config_digest"} <= prov.keys()))


def enclosing_run(path: Path) -> Path | None:
    """The nearest folder at or above ``path`` that is trainrun's: one with its marker (a run
    or a checkpoint directory) or a run from before the marker; None when there is none."""
    for folder in [path, *path.parents]:
        if (folder / MARKER).is_file() or ((folder / CONFIG).is_file() and _by_trainrun(folder)):
            return folder
    return None


def inspect(path: Path, role: str = "run") -> Found:
    """What ``path`` holds, read without writing anything."""
    if not path.exists():
        return Found("absent")
    if not path.is_dir():
        return Found("foreign", "it is a file, not a directory")
    names = {p.name for p in path.iterdir()}
    if not names:
        return Found("empty")
    if MARKER in names:
        marker = _json(path / MARKER)
        if not isinstance(marker, dict) or not isinstance(marker.get("format"), int):
            return Found("foreign", f"its {MARKER} cannot be read")
        if marker["format"] > FORMAT:
            raise UserError(f"{path} was written by a newer trainrun (run directory format "
                            f"{marker['format']}; this one reads {FORMAT}); use that version, "
                            "or give another directory")
        if marker.get("holds", "run") != role:
            return Found("foreign", f"it holds trainrun {marker.get('holds')}, not a {role}")
        return Found("marked")
    ckpts = path / CHECKPOINTS
    if role == "run":
        if CONFIG in names and _by_trainrun(path):
            return Found("legacy")
        if names <= {LOCK, CHECKPOINTS} and (
                CHECKPOINTS not in names or (ckpts.is_dir() and not any(ckpts.iterdir()))):
            return Found("leftover")
    else:  # step directories (each with trainrun's meta/), partial saves and corrupt/ only
        if names == {LOCK}:
            return Found("leftover")
        steps = [p for p in path.iterdir() if p.name.isdigit()]
        if (steps and all((p / "meta").is_dir() for p in steps)
                and all(n.isdigit() or ORBAX_TMP in n or n in ("corrupt", LOCK)
                        for n in names)):
            return Found("legacy")
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    return Found("foreign", f"it holds {shown} and no {MARKER}")


class RunDirectory:
    """The folders one run writes: its run directory and, when ``checkpoint.dir`` puts them
    elsewhere, its checkpoint directory.

    ``check`` refuses a folder that is not trainrun's (or is in use) before anything is
    written, and takes the lock of an existing one at once; ``claim``, once the run's inputs
    are known to be good, moves an old run aside (``--fresh``), creates and locks the folders
    and writes their markers; ``withdraw`` undoes that for a run refused before it started.
    ``release`` (or the process ending) frees the locks.
    """

    def __init__(self, run_dir: Path, ckpt_dir: Path, fresh: bool = False):
        self.run_dir, self.ckpt_dir, self.fresh = Path(run_dir), Path(ckpt_dir), fresh
        self.folders = [(self.run_dir, "--run-dir", "run")]
        if os.path.abspath(ckpt_dir) != os.path.abspath(self.run_dir / CHECKPOINTS):
            self.folders.append((self.ckpt_dir, "checkpoint.dir", "checkpoints"))
        self.locks: dict[Path, RunLock] = {}
        # What claim changed, for withdraw: folders it created, the entries an existing folder
        # held before it, and runs it moved aside (path, where to, whether it had a lock file).
        self.created: list[Path] = []
        self.held_before: dict[Path, set[str]] = {}
        self.moved: list[tuple[Path, Path, bool]] = []

    @property
    def display(self) -> Any:
        """The run directory as the user named it (a stage's bucket location)."""
        return self.run_dir

    def finish(self) -> None:
        """The run ended as it should: nothing left to do for a local directory."""

    def check(self) -> None:
        for path, flag, _ in self.folders:
            require_utf8(path, flag)
            require_fits(path, flag)
            require_no_links(path)
        if not self.fresh:  # --fresh moves the old steps aside instead
            require_real_steps(self.ckpt_dir)
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
        if self.ckpt_dir.is_dir():  # Orbax writes into it after the claim
            self.held_before.setdefault(self.ckpt_dir, {p.name for p in self.ckpt_dir.iterdir()})
        if (existed[self.run_dir].kind in ("marked", "legacy", "leftover")
                and not committed_steps(self.ckpt_dir)):
            notices.append(f"taking over {self.run_dir}: it holds no checkpoint (its run "
                           "stopped or was refused before the first one); starting at step 0")
        return notices

    def withdraw(self) -> None:
        """Undo ``claim`` for a run refused before it started: remove the folders it created
        and what it added to existing ones, and move a run it moved aside back. Call while the
        locks are held (nobody else wrote there since the claim)."""
        for path, names in self.held_before.items():
            for entry in path.iterdir() if path.is_dir() else ():
                if entry.name in names:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        entry.unlink()
        claimed = {path for path, _, _ in self.folders}
        for path in self.created:
            if path in claimed:
                shutil.rmtree(path, ignore_errors=True)
        for path in sorted(set(self.created) - claimed, key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):  # a parent: another run may have started in it
                path.rmdir()
        for path, target, had_lock in reversed(self.moved):
            if not path.exists():
                target.rename(path)
                if not had_lock:
                    (path / LOCK).unlink(missing_ok=True)
        self.created, self.held_before, self.moved = [], {}, []

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
