"""The steps of a checkpoint directory: which saves committed, and which were cut short."""

from __future__ import annotations

from pathlib import Path

from trainrun.rundir.layout import COMMIT_FILE
from trainrun.storage import location


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
