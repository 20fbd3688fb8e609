"""``trainrun export``: a run's newest readable checkpoint written as a Hugging Face model
directory.

The directory is written under a temporary name beside ``to`` and renamed into place once
complete, so a failure midway (a full disk) leaves ``to`` as it was. ``to`` must be new or
empty; ``replace`` swaps a model directory already there for the new export, nothing of the
old one kept.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

import jax
import numpy as np

from trainrun.checkpointing.reader import latest_params, saved_config
from trainrun.errors import UserError
from trainrun.models.huggingface import CONFIG, WEIGHTS, WeightsError, write_model_dir
from trainrun.models.transformer import merge_adapters


class ExportRefused(UserError):
    """A ``--to`` that export will not write to; the CLI prints it on one line and exits 2."""


def export_run(run_dir: Path, to: Path, *, merge: bool = False,
               replace: bool = False) -> tuple[int, Path]:
    """A run's newest readable checkpoint as a GPT-2 model directory: ``(step, to)``. A model
    with LoRA adapters needs ``merge`` (GPT-2's layout has no place for them). ``to`` must be
    new or empty, or, with ``replace``, a model directory, which then holds the new export
    only."""
    to = Path(to)
    check_target(to, replace)
    config = saved_config(run_dir)
    cfg = config.model
    if cfg.kind != "transformer":
        raise WeightsError(f"run {run_dir} trains model.kind={cfg.kind}; export writes the "
                           "transformer in GPT-2's layout")
    if cfg.lora is not None and not merge:
        raise WeightsError("the model has LoRA adapters, which GPT-2's layout cannot hold; "
                           "pass --merge to fold them into the weights")
    step, params = latest_params(run_dir, config)
    cfg, params = merge_adapters(cfg, jax.tree.map(np.asarray, params))
    target = Path(os.path.realpath(to))  # a link to a directory: the directory is replaced
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.export-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        write_model_dir(params, cfg, staging)
        _swap(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return step, to


def check_target(to: Path, replace: bool) -> None:
    """Refuse a ``--to`` that is a file, or a directory with files in it (unless ``replace``
    and it is a model directory), before anything is read or written."""
    if to.exists() and not to.is_dir():
        raise ExportRefused(f"--to {to} is a file, not a directory; give a directory for the "
                            "export (a new or empty one)")
    names = sorted(p.name for p in to.iterdir()) if to.is_dir() else []
    if not names:
        return
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if not replace:
        raise ExportRefused(f"--to {to} is not empty (it holds {shown}); pass --replace to "
                            "replace it with this export, or give a new or empty directory")
    if CONFIG not in names and WEIGHTS not in names:
        raise ExportRefused(f"--to {to} holds {shown} and no {CONFIG} or {WEIGHTS}: it is not "
                            "a model directory, so --replace does not delete it; give a new "
                            "or empty directory or a model directory")


def _swap(staging: Path, target: Path) -> None:
    """``staging`` renamed to ``target``; an old ``target`` is moved aside first, put back if
    the rename fails, and deleted once the new one is in place."""
    if not target.exists():
        staging.rename(target)
        return
    old = staging.with_name(staging.name + ".old")
    target.rename(old)
    try:
        staging.rename(target)
    except BaseException:
        with contextlib.suppress(OSError):
            old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)
