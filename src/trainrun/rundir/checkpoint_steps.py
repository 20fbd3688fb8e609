"""The steps of a checkpoint directory: which saves committed, and which were cut short."""

from __future__ import annotations

import os

from trainrun.rundir.layout import COMMIT_FILE
from trainrun.storage import location
from trainrun.storage.location import Location


def committed_steps(ckpt_dir: Location | str | os.PathLike[str]) -> list[int]:
    """The committed steps of a checkpoint directory, oldest first: locally the step folders
    (Orbax renames a step to its number only once every file is written); on object storage,
    which has no rename, the step folders holding Orbax's commit file (written last)."""
    ckpt_dir = location.location(ckpt_dir)  # a path given here enters here
    if not ckpt_dir.renames:
        return sorted(int(name) for name in ckpt_dir.list_names()
                      if name.isdigit() and (ckpt_dir / name / COMMIT_FILE).exists())
    return sorted(int(name) for name in ckpt_dir.list_names()
                  if name.isdigit() and (ckpt_dir / name).is_dir())


def uncommitted_steps(ckpt_dir: Location | str | os.PathLike[str]) -> list[str]:
    """On object storage, the step folders without Orbax's commit file: saves cut short (or
    still being written), never read as checkpoints."""
    ckpt_dir = location.location(ckpt_dir)  # a path given here enters here
    return [name for name in ckpt_dir.list_names()
            if name.isdigit() and not (ckpt_dir / name / COMMIT_FILE).exists()]
