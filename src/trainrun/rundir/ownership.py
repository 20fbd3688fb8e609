"""Whose folder is it: trainrun writes only into a folder it can tell is its own.

That is one it creates (the marker is its first file, before ``checkpoints/``), an empty one, or
one holding the marker. A run directory written before the marker existed is recognised by the
``status.json`` or ``provenance.json`` trainrun wrote beside its ``config.yaml`` (keys no user
file is likely to share) and is marked when next trained. Any other folder is refused before
anything is written, renamed or trimmed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from trainrun.errors import UserError
from trainrun.rundir.layout import (
    CHECKPOINTS,
    CONFIG,
    FORMAT,
    MARKER,
    ORBAX_TMP,
    PROVENANCE,
    STATUS,
)
from trainrun.rundir.lock import LOCK
from trainrun.rundir.run_files import write_json
from trainrun.rundir.status import STATUSES
from trainrun.storage import location


def write_marker(folder: Path, role: str) -> None:
    """The marker that says ``folder`` is trainrun's: a run, or a checkpoint directory."""
    write_json(location.local(folder) / MARKER, {
        "format": FORMAT, "holds": role,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})


@dataclasses.dataclass(frozen=True)
class Found:
    """What a folder holds, for a run directory (``role`` "run") or a checkpoint directory kept
    elsewhere ("checkpoints"): absent | empty | marked (its marker says trainrun's) | legacy
    (trainrun's, from before the marker) | leftover (nothing but an empty ``checkpoints/`` or
    a lock file: a run that died before its marker) | foreign (``why`` says what is there)."""

    kind: str
    why: str = ""


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
        return _by_marker(path, role)
    unmarked = (_unmarked_run(path, names) if role == "run"
                else _unmarked_checkpoints(path, names))
    if unmarked is not None:
        return unmarked
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    return Found("foreign", f"it holds {shown} and no {MARKER}")


def _by_marker(path: Path, role: str) -> Found:
    """What a folder with trainrun's marker holds: a ``role`` (marked), trainrun's other kind,
    or a marker it cannot read (foreign)."""
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


def _unmarked_run(path: Path, names: set[str]) -> Found | None:
    """A run directory from before the marker, or what a run left with nothing but its lock
    and an empty checkpoints folder; None when ``names`` are neither."""
    ckpts = path / CHECKPOINTS
    if CONFIG in names and _by_trainrun(path):
        return Found("legacy")
    if names <= {LOCK, CHECKPOINTS} and (
            CHECKPOINTS not in names or (ckpts.is_dir() and not any(ckpts.iterdir()))):
        return Found("leftover")
    return None


def _unmarked_checkpoints(path: Path, names: set[str]) -> Found | None:
    """A checkpoint directory from before the marker (step directories each with trainrun's
    meta/, partial saves and corrupt/ only), or one with only its lock; None otherwise."""
    if names == {LOCK}:
        return Found("leftover")
    steps = [p for p in path.iterdir() if p.name.isdigit()]
    if (steps and all((p / "meta").is_dir() for p in steps)
            and all(n.isdigit() or ORBAX_TMP in n or n in ("corrupt", LOCK) for n in names)):
        return Found("legacy")
    return None
