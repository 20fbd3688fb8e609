"""``trainrun export``: a run's newest readable checkpoint written as a Hugging Face model
directory (the family its ``init.from`` source was, else the one its layout is), or, for a run
with LoRA adapters and no ``--merge``, as a PEFT adapter directory for its base model.

Beside the weights go the source directory's tokenizer files and generation config, or the
run's own ``data.tokenizer``; ``bos_token_id`` and ``eos_token_id`` come from them.

The directory is written under a temporary name beside ``to`` and renamed into place once
complete, so a failure midway (a full disk) leaves ``to`` as it was. ``to`` must be new or
empty; ``replace`` swaps a model directory already there for the new export, nothing of the
old one kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainrun import rundir
from trainrun.checkpointing.reader import latest_params, saved_config
from trainrun.config import RunConfig
from trainrun.errors import UserError
from trainrun.models import peft
from trainrun.models.huggingface import (
    CONFIG,
    INDEX,
    TOKENIZER_FILES,
    WEIGHTS,
    WeightsError,
    model_type_of,
    parse_size,
    read_config,
    write_model_dir,
)
from trainrun.models.transformer import merge_adapters

DTYPES = ("float32", "bfloat16", "float16")
# What makes a directory a model directory, which --replace may replace.
MODEL_FILES = (CONFIG, WEIGHTS, INDEX, peft.ADAPTER_CONFIG, peft.ADAPTER_WEIGHTS)


class ExportRefused(UserError):
    """A ``--to`` that export will not write to; the CLI prints it on one line and exits 2."""


@dataclasses.dataclass(frozen=True)
class Export:
    """What ``export_run`` wrote: the checkpoint's step, the directory, and its files."""

    step: int
    path: Path
    files: tuple[str, ...]


def export_run(run_dir: Path, to: Path, *, merge: bool = False, replace: bool = False,
               dtype: str = "float32", shard_size: str = "5GB") -> Export:
    """A run's newest readable checkpoint as a model directory (``merge``: adapters folded
    into the weights) or, with LoRA adapters and no ``merge``, an adapter directory.
    ``to`` must be new or empty, or, with ``replace``, a model directory, which then holds the
    new export only. ``dtype``: the weights' dtype in the files; ``shard_size``: the most bytes
    per file."""
    to = Path(to)
    check_target(to, replace)
    if dtype not in DTYPES:
        raise WeightsError(f"--dtype {dtype}: give one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(shard_size)
    config = saved_config(run_dir)
    cfg = config.model
    if cfg.kind != "transformer":
        raise WeightsError(f"run {run_dir} trains model.kind={cfg.kind}; export writes "
                           "transformers in Hugging Face's layout")
    source = _source_dir(config)
    hf = read_config(source) if source is not None else None
    model_type = str(hf["model_type"]) if hf is not None else model_type_of(cfg)
    step, params = latest_params(run_dir, config)
    params = jax.tree.map(np.asarray, params)
    target = Path(os.path.realpath(to))  # a link to a directory: the directory is replaced
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.export-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        if cfg.lora is not None and not merge:
            peft.write_adapter_dir(params, cfg, model_type,
                                   str(source.absolute()) if source is not None else None,
                                   staging)
        else:
            cfg, params = merge_adapters(cfg, params)
            hf = {**(hf or {}), **_token_ids(config, source)}
            write_model_dir(params, cfg, staging, model_type=model_type, source=hf,
                            dtype=dtype, shard_bytes=shard_bytes)
        _copy_tokenizer(config, source, staging)
        files = tuple(sorted(p.name for p in staging.iterdir()))
        _swap(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Export(step, to, files)


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
    if not set(MODEL_FILES) & set(names):
        raise ExportRefused(f"--to {to} holds {shown} and no {CONFIG} or weights: it is not "
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


def _source_dir(config: RunConfig) -> Path | None:
    """The Hugging Face directory the run started from, where it still is: through an adapter
    directory to its base model, and through runs that started from other runs."""
    seen: set[Path] = set()
    while config.init.from_ is not None:
        path = Path(config.init.from_).expanduser()
        if (path / peft.ADAPTER_CONFIG).is_file():
            name = peft.base_model_name(path)
            path = Path(name).expanduser() if name else path
        if (path / CONFIG).is_file():
            return path
        if path.resolve() in seen or not (path / rundir.CONFIG).is_file():
            return None
        seen.add(path.resolve())
        try:
            config = saved_config(path)
        except UserError:
            return None
    return None


def _tokenizer_file(config: RunConfig) -> Path | None:
    name = getattr(config.data, "tokenizer", None)
    return Path(name).expanduser() if name and Path(name).expanduser().is_file() else None


def _token_ids(config: RunConfig, source: Path | None) -> dict[str, Any]:
    """bos/eos ids: the run's own tokenizer's document token, the source's ids, or those in
    the source's generation config."""
    own = _tokenizer_file(config)
    if own is not None:
        from tokenizers import Tokenizer

        from trainrun.data.tokenizer import DOCUMENT_TOKEN

        token = Tokenizer.from_file(str(own)).token_to_id(DOCUMENT_TOKEN)
        if token is not None:  # each document starts with it: the model's bos and eos
            return {"bos_token_id": token, "eos_token_id": token}
    if source is not None and (source / "generation_config.json").is_file():
        try:
            generation = json.loads((source / "generation_config.json").read_text())
        except (OSError, ValueError):
            return {}
        return {k: generation[k] for k in ("bos_token_id", "eos_token_id") if k in generation}
    return {}


def _copy_tokenizer(config: RunConfig, source: Path | None, to: Path) -> None:
    """The source's tokenizer files and generation config; the run's own tokenizer.json over
    them (it is what the run was trained with)."""
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, to / name)
    own = _tokenizer_file(config)
    if own is not None:
        shutil.copyfile(own, to / "tokenizer.json")
