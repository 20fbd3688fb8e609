"""The run directory: what a run leaves on disk, and where.

    <run dir>/config.yaml       the resolved config
              provenance.json   what the run was measured on
              metrics.jsonl     one line per training step (and per eval)
              summary.json      written at the end: final loss, timing, throughput
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from trainrun.config import RunConfig, dump_yaml
from trainrun.errors import UserError

CONFIG = "config.yaml"
PROVENANCE = "provenance.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


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


def start_fresh(run_dir: Path, config: RunConfig, provenance: dict[str, Any],
                fresh: bool) -> Path | None:
    """Create ``run_dir`` for a new run; returns where an old run was moved, if anywhere.

    An existing run is never overwritten: without ``fresh`` it is an error that says how to
    keep or replace it.
    """
    moved = None
    if run_dir.exists() and any(run_dir.iterdir()):
        if not fresh:
            raise UserError(f"run directory {run_dir} already holds a run; pass --fresh to move "
                            "it aside and start over, or --run-dir for another directory")
        moved = move_aside(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG).write_text(dump_yaml(config))
    write_json(run_dir / PROVENANCE, provenance)
    return moved
