"""Where a run stands (``status.json``: running, finished, preempted or failed, and by which
process) and what it ended with (``summary.json``)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from typing import Any

from trainrun.rundir.checkpoint_steps import committed_steps
from trainrun.rundir.layout import STATUS, SUMMARY
from trainrun.rundir.run_files import DamagedFile, read_json, write_json
from trainrun.storage import location
from trainrun.storage.location import Location

STATUSES = ("running", "finished", "preempted", "failed")


def finished_message(run_dir: Location, step: int, steps: int) -> str:
    over = ("pass --fresh (moves this run aside)" if run_dir.renames
            else "give a new --run-dir (a bucket cannot move a run aside)")
    return (f"{run_dir} is finished: its last checkpoint is at step {step} (config steps="
            f"{steps}). To train it further pass steps=N with N > {step}; to start over {over}.")


def read_summary(run_dir: Location) -> dict[str, Any]:
    path = run_dir / SUMMARY
    return read_json(path) if path.exists() else {}


def write_status(run_dir: Location, status: str, step: int | None = None,
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


def mark_failed(run_dir: Location, reason: str, ckpt_dir: Location | None = None,
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
            with os.fdopen(os.open(str(run_dir / STATUS), os.O_RDWR | os.O_NOFOLLOW), "r+b") as f:
                f.write(text.encode())
                f.truncate()


def resume_point(ckpt_dir: Location, until: str = "") -> str:
    """Where a resume of a failed run starts, as its one line says it: the last committed
    checkpoint (``until``: what the same command waits for, e.g. " once the store answers")."""
    steps = committed_steps(ckpt_dir)
    return (f"the last committed checkpoint is step {steps[-1]} (the same command resumes from "
            f"it{until})" if steps else "no checkpoint was committed")


def record_stopped(run_dir: Location, ckpt_dir: Location, reason: str,
                   pid: int | None = None) -> str:
    """A run whose processes were stopped from outside (``trainrun launch`` saw it, or a second
    signal aborted it): marked ``failed`` with ``reason`` and where a resume starts, which the
    returned line says too. pid: the process that ran it (default this one)."""
    line = f"{reason}; {resume_point(ckpt_dir)}"
    mark_failed(run_dir, line, ckpt_dir, pid=pid)
    return line


def read_status(run_dir: Location | str | os.PathLike[str]) -> dict[str, Any]:
    """The recorded status; ``running`` whose process is gone from this host reads as
    ``failed``. A run without a status file (written before there were any) reads as
    ``finished`` if it has a summary, else ``unknown``."""
    run_dir = location.location(run_dir)  # a path given here enters here
    path = run_dir / STATUS
    if not path.exists():
        return {"status": "finished" if (run_dir / SUMMARY).exists() else "unknown"}
    try:
        status = read_json(path)
    except DamagedFile:
        return {"status": "unknown"}
    if status.get("status") == "running" and not run_dir.renames:
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
