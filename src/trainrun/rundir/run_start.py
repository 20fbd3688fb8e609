"""A run's files as it (re)starts at a step: its config, its provenance, and its metrics cut
back to that step, so that each step is written once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainrun.config import RunConfig, dump_yaml
from trainrun.rundir.layout import CONFIG, METRICS, PROVENANCE, TIMING
from trainrun.rundir.run_files import write_json, write_text


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
