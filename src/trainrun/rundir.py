"""The run directory: what a run leaves on disk, and where.

    <run dir>/config.yaml       the resolved config
              provenance.json   what the run was measured on
              metrics.jsonl     one line per training step (and per eval)
              summary.json      written at the end: final loss, timing, throughput
              timing.jsonl      one line per timing window: device time per step
              status.json       running | finished | preempted | failed, and by which process
              tensorboard/      TensorBoard event files
              checkpoints/      Orbax step directories (see checkpoint.py)

A run directory with a committed checkpoint resumes from it; ``--fresh`` moves the run aside.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any

from trainrun.config import RunConfig, dump_yaml
from trainrun.errors import UserError

CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
TIMING = "timing.jsonl"
STATUS = "status.json"
STATUSES = ("running", "finished", "preempted", "failed")


def default_run_dir(config: RunConfig) -> Path:
    return Path("runs") / config.name


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Written to a temporary name and renamed: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def move_aside(run_dir: Path) -> Path:
    """``runs/x`` -> ``runs/x.old-<UTC time>``: a fresh start never deletes a run."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    run_dir.rename(target)
    return target


def move_runs_aside(paths: list[Path]) -> list[tuple[Path, Path]]:
    """``--fresh``: each existing, non-empty path (the run dir; a checkpoint dir kept
    elsewhere) is renamed aside, never deleted. Returns ``(old, new)`` pairs."""
    moved = []
    for path in paths:
        if path.exists() and any(path.iterdir()):
            moved.append((path, move_aside(path)))
    return moved


def check_run_dir(run_dir: Path) -> None:
    """A non-empty directory that holds no run is not ours to write into."""
    if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / CONFIG).exists():
        raise UserError(f"{run_dir} is not empty and holds no trainrun run (no {CONFIG}); "
                        "give --run-dir an empty or new directory")


def start(run_dir: Path, config: RunConfig, provenance: dict[str, Any], step: int) -> None:
    """Write the run's files for a run (re)starting at ``step``: the config (``steps`` may have
    grown), this process's provenance, and ``metrics.jsonl`` cut back to ``step`` so that each
    step is in it once."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG).write_text(dump_yaml(config))
    write_json(run_dir / PROVENANCE, provenance)
    truncate_metrics(run_dir / METRICS, step)
    truncate_metrics(run_dir / TIMING, step)


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the lines of steps after ``step`` (written before a kill, recomputed on resume);
    returns how many were dropped. Rewritten to a temporary name and renamed, like JSON."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and _line_step(line) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
    return len(lines) - len(kept)


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line from a kill: dropped


def finished_message(run_dir: Path, step: int, steps: int) -> str:
    return (f"{run_dir} is finished: its last checkpoint is at step {step} (config steps="
            f"{steps}). To train it further pass steps=N with N > {step}; to start over pass "
            "--fresh (moves this run aside).")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SUMMARY
    return read_json(path) if path.exists() else {}


def write_status(run_dir: Path, status: str, step: int | None = None) -> None:
    """Record where a run stands (``trainrun runs`` reads it): one of ``STATUSES``, the step if
    known, and the process that wrote it (so a run whose process died shows as failed)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    write_json(run_dir / STATUS, {
        "status": status,
        "step": step,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    })


def read_status(run_dir: Path) -> dict[str, Any]:
    """The recorded status; ``running`` whose process is gone from this host reads as
    ``failed``. A run without a status file (written before there were any) reads as
    ``finished`` if it has a summary, else ``unknown``."""
    path = run_dir / STATUS
    if not path.exists():
        return {"status": "finished" if (run_dir / SUMMARY).exists() else "unknown"}
    try:
        status = read_json(path)
    except ValueError:
        return {"status": "unknown"}
    if status.get("status") == "running" and status.get("host") == socket.gethostname():
        try:
            os.kill(int(status["pid"]), 0)
        except ProcessLookupError:
            status = {**status, "status": "failed", "note": "process gone"}
        except (PermissionError, KeyError, TypeError, ValueError):
            pass
    return status
