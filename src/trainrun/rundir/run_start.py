"""A run's files as it (re)starts at a step: its config, its provenance, the fingerprints of
the data files it reads, the tokenizer it reads them with, and its metrics cut back to that
step, so that each step is written once."""

from __future__ import annotations

import json
from typing import Any

from trainrun.config import RunConfig, dump_yaml
from trainrun.rundir.layout import (
    COMPLETIONS,
    CONFIG,
    DATA_FILES,
    METRICS,
    PROVENANCE,
    TIMING,
    TOKENIZER,
)
from trainrun.rundir.run_files import DamagedFile, read_json, write_json, write_text
from trainrun.storage.location import LocalLocation, Location


def start(run_dir: LocalLocation, config: RunConfig, provenance: dict[str, Any], step: int,
          data_files: dict[str, str] | None = None,
          tokenizer: dict[str, str] | None = None) -> None:
    """Write the run's files for a run (re)starting at ``step``: the config (``steps`` may have
    grown), this process's provenance, the fingerprint of each data file it reads (None: data
    given as a dataset, nothing recorded), the files of the tokenizer it reads text with (None:
    none), and ``metrics.jsonl`` (``timing.jsonl``, ``completions.jsonl``) cut back to ``step``
    so that each step is in it once."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / CONFIG, dump_yaml(config))
    write_json(run_dir / PROVENANCE, provenance)
    if data_files is not None:
        write_json(run_dir / DATA_FILES, {"files": data_files})
    if tokenizer is not None:
        keep_tokenizer(run_dir / TOKENIZER, tokenizer)
    truncate_metrics(run_dir / METRICS, step)
    truncate_metrics(run_dir / TIMING, step)
    truncate_metrics(run_dir / COMPLETIONS, step)


def keep_tokenizer(folder: LocalLocation, files: dict[str, str]) -> None:
    """The tokenizer's files in the run's ``tokenizer/`` folder, each written whole where it
    differs from what is there (a resume on the same tokenizer rewrites nothing)."""
    folder.mkdir(exist_ok=True)
    for name, text in files.items():
        path = folder / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            write_text(path, text)


def read_data_files(run_dir: Location) -> dict[str, str] | None:
    """The data files' fingerprints a run recorded as it started (``start``); None for a run
    that recorded none (one from before the record, or trained on a dataset it was given)."""
    path = run_dir / DATA_FILES
    if not path.is_file():
        return None
    files = read_json(path).get("files")
    if not isinstance(files, dict):
        raise DamagedFile(path, "no mapping of files")
    return {str(name): str(fingerprint) for name, fingerprint in files.items()}


def truncate_metrics(path: Location, step: int) -> int:
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
