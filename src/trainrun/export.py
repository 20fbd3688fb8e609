"""``trainrun export``: a run's newest readable checkpoint (or ``--step N``'s) written as a
Hugging Face model directory (the family its ``init.from`` source was, else the one its layout
is), or, for a run with LoRA adapters and no ``--merge``, as a PEFT adapter directory for its
base model.

Beside the weights go the source directory's tokenizer files and generation config, or the
run's own tokenizer (a run on records with no source: the tokenizer folder it keeps, chat
template and stop ids included); ``bos_token_id`` and ``eos_token_id`` come from them. A file of
the source that is a symbolic link is read only where the link stays inside the source (its
real path) or, for a Hugging Face hub snapshot (``.../snapshots/<revision>``), inside the
repository's folder that holds ``snapshots/`` and ``blobs/``, where the hub keeps the files its
snapshots link to; a link anywhere else (a ``special_tokens_map.json`` pointing at a key) is
refused on one line naming the link and its target, before anything is written. A text run's
own tokenizer is the copy it keeps (``tokenizer/``), else the file its ``data.tokenizer`` names,
read wherever that is.

Where the export may go, and what ``--replace`` may replace: ``rundir.export_dir``. The
directory is written under a temporary name beside ``to`` and renamed into place once
complete, so a failure midway (a full disk) leaves ``to`` as it was, and is reported on one
line naming ``to`` and the cause (exit 1).

The run may be on object storage (``gs://``, ``s3://``: read as any run is), and so may ``to``:
there the export is written in a local temporary folder and uploaded, its ``config.json`` (or
``adapter_config.json``) last, as the mark that it is whole (``rundir.export_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainrun import rundir
from trainrun.checkpointing.checkpoints import checkpoint_dir
from trainrun.checkpointing.init_from import source_location
from trainrun.checkpointing.reader import latest_params, saved_config
from trainrun.checkpointing.run_context import run_model
from trainrun.config import RecordsData, RunConfig, TextData
from trainrun.data import kept_tokenizer
from trainrun.errors import UserError, WriteFailed, path_refused
from trainrun.models import peft
from trainrun.models.huggingface import (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER_FILES,
    WeightsError,
    model_type_of,
    parse_size,
    read_config,
    write_model_dir,
)
from trainrun.models.reward_transformer import SCORE
from trainrun.models.transformer import merge_adapters
from trainrun.rundir import export_dir, write_failures
from trainrun.rundir.export_dir import ExportRefused, check_target
from trainrun.storage import location
from trainrun.storage.atomic import create_new
from trainrun.storage.location import LocalLocation, Location

DTYPES = ("float32", "bfloat16", "float16")
_ERRNO = {what: code for code, what in write_failures.REFUSED.items()}


@dataclasses.dataclass(frozen=True)
class Export:
    """What ``export_run`` wrote: the checkpoint's step, the directory, and its files."""

    step: int
    path: Location
    files: tuple[str, ...]


def export_run(run_dir: Location | str, to: Location | str, *,
               merge: bool = False, replace: bool = False, dtype: str = "float32",
               shard_size: str = "5GB", step: int | None = None) -> Export:
    """A run's newest readable checkpoint (or that of ``step``) as a model directory
    (``merge``: adapters folded into the weights) or, with LoRA adapters and no ``merge``, an
    adapter directory.
    ``to`` must be new or empty, or, with ``replace``, a model directory, which then holds the
    new export only (``rundir.export_dir`` says which folders are refused). ``dtype``: the
    weights' dtype in the files; ``shard_size``: the most bytes per file. Either path may be
    on object storage (``gs://``, ``s3://``)."""
    run = location.location(run_dir)
    with tempfile.TemporaryDirectory(prefix="trainrun-kept-tokenizer-") as held:
        return _export(run, location.location(to), _kept_here(run, Path(held)), merge=merge,
                       replace=replace, dtype=dtype, shard_size=shard_size, step=step)


def _export(run: Location, dest: Location, kept: Path | None, *, merge: bool, replace: bool,
            dtype: str, shard_size: str, step: int | None) -> Export:
    """``export_run`` of ``run`` to ``dest``; ``kept``: the tokenizer the run keeps, here."""
    here = dest.local_path  # None on object storage, where nothing is renamed
    target = None if here is None else Path(os.path.realpath(here))  # a link: its folder replaced
    if here is None or target is None:
        export_dir.check_remote_target(dest, replace, run)
    else:
        export_dir.restore_interrupted(target)
        check_target(here, replace, run)
    if dtype not in DTYPES:
        raise WeightsError(f"--dtype {dtype}: give one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(shard_size)
    config = saved_config(run)
    cfg = config.model
    if cfg.kind != "transformer":
        raise WeightsError(f"run {run} trains model.kind={cfg.kind}; export writes "
                           "transformers in Hugging Face's layout")
    source, reads = _lineage(run, config)
    own = _tokenizer_file(kept, config)
    export_dir.check_reads(dest, [
        (run, "the run being exported"),
        (checkpoint_dir(config, run), f"the checkpoints of {run}"), *reads,
        *([(own, f"the data.tokenizer of {run}")] if own is not None else [])])
    copies = (_source_files(source, TOKENIZER_FILES) if source is not None
              else _kept_records_tokenizer(kept, config))
    hf = None
    if source is not None:
        _source_files(source, (CONFIG,))  # its fields go into the export: a link is checked
        hf = read_config(source)
    model_type = str(hf["model_type"]) if hf is not None else model_type_of(cfg)
    step, params = latest_params(run, config, step)
    params = jax.tree.map(np.asarray, params)
    if cfg.lora is not None and not merge and SCORE in params:  # PEFT's files hold no score head
        raise WeightsError(f"run {run} trains a reward model with LoRA adapters, which exports "
                           "as one model directory: give --merge")

    def write(staging: Path) -> tuple[str, ...]:
        """The export's files written into the new folder ``staging``; their names."""
        # the context load(RUN) generates within is the export's max_position_embeddings
        model, weights, source_config = run_model(config), params, hf
        if model.lora is not None and not merge:
            peft.write_adapter_dir(weights, model, model_type,
                                   str(source.absolute()) if source is not None else None,
                                   staging)
        else:
            model, weights = merge_adapters(model, weights)
            ids = _token_ids(own, copies)
            # the run's own tokenizer's ids are what it trained with; else the source's stand
            source_config = ({**(source_config or {}), **ids} if own is not None
                             else {**ids, **(source_config or {})})
            write_model_dir(weights, model, staging, model_type=model_type,
                            source=source_config, dtype=dtype, shard_bytes=shard_bytes)
        _copy_tokenizer(copies, own, staging)
        return tuple(sorted(p.name for p in staging.iterdir()))

    if target is None:  # no rename there: staged here, uploaded with its mark last
        with tempfile.TemporaryDirectory(prefix="trainrun-export-") as staged:
            files = write(Path(staged))
            export_dir.publish(Path(staged), dest)
        return Export(step, dest, files)
    return Export(step, dest, _swapped_in(write, target, dest))


def _swapped_in(write: Callable[[Path], tuple[str, ...]], target: Path,
                dest: Location) -> tuple[str, ...]:
    """The names of the files ``write`` puts in a new folder beside ``target``, which then
    replaces ``target`` in one rename (``dest``: the path as given, ``target`` where it
    leads). A write the file system refuses is one line, with ``target`` as it was."""
    export_dir.remove_leftovers(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = export_dir.staging_dir(target)
        try:
            files = write(staging)
            export_dir.swap(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except Exception as err:
        what = _refused_write(err, target)
        if what is None:
            raise
        line, _ = path_refused(OSError(_ERRNO[what], what, str(dest)))
        raise WriteFailed(f"{line} (the export was not written; {dest} is as it was)") from None
    return files


def _refused_write(err: BaseException, target: Path) -> str | None:
    """What the file system refused (``write_failures.REFUSED``'s words) when ``err`` is a write of
    the export beside ``target`` it refused (safetensors reports one in its own error's text);
    None for anything else, a file read elsewhere included (the CLI names that one)."""
    refused = write_failures.refused_write(err)
    if refused is None:
        return None
    what, file = refused
    if file is not None and not Path(file).is_relative_to(target.parent):
        return None
    return what


def _lineage(run_dir: Location, config: RunConfig,
             ) -> tuple[LocalLocation | None, list[tuple[Location, str]]]:
    """The Hugging Face directory the run started from, where it still is (through an adapter
    directory to its base model, and through runs that started from other runs, on disk or on
    object storage), and every path along that ``init.from`` chain, each with what it is to
    the export."""
    reads: list[tuple[Location, str]] = []
    seen: set[object] = set()
    name = run_dir
    while config.init.from_ is not None:
        path = source_location(config.init.from_)
        reads.append((path, f"the init.from of {name}"))
        here = path.local_path
        if here is not None:  # a model or adapter directory is read locally
            folder = location.local(here)
            if (folder / peft.ADAPTER_CONFIG).is_file():
                base = _adapter_base(folder)
                if base is not None:
                    reads.append((base, f"the base model of the adapters in {path}"))
                    folder = base
            if (folder / CONFIG).is_file():
                return folder, reads
        key = path.real()
        if key in seen or not (path / rundir.CONFIG).is_file():
            return None, reads
        seen.add(key)
        try:
            config = saved_config(path)
        except UserError:
            return None, reads
        name = path
    return None, reads


def _adapter_base(adapters: LocalLocation) -> LocalLocation | None:
    """An adapter directory's base model as a path, as ``init.from`` reads it: relative to the
    adapter directory when it is there, else as written."""
    name = peft.base_model_name(adapters)
    if not name:
        return None
    base = location.local(name)
    return adapters / base if not base.is_absolute() and (adapters / base).is_dir() else base


def _source_files(source: LocalLocation, names: tuple[str, ...]) -> dict[str, Path]:
    """The files of ``names`` the source directory has, each as the path to read: a symbolic
    link only where it stays inside the source or its hub repository's folder; any other link
    is refused on one line naming it and its target (``location.model_file``)."""
    found = {}
    for name in names:
        path = (source / name).model_file(ExportRefused)
        if path.is_file():
            found[name] = Path(os.path.realpath(path)) if path.is_symlink() else path
    return found


def _tokenizer_file(kept: Path | None, config: RunConfig) -> LocalLocation | None:
    """The run's own tokenizer.json: for a text run the copy it keeps (``kept``), else the
    file ``data.tokenizer`` names; None where it names none."""
    name = getattr(config.data, "tokenizer", None)
    if not name:
        return None
    if isinstance(config.data, TextData) and kept is not None:
        return location.local(kept / kept_tokenizer.TOKENIZER_JSON)
    return location.local(name) if location.local(name).is_file() else None


def _kept_records_tokenizer(kept: Path | None, config: RunConfig) -> dict[str, Path]:
    """A run on records with no source model: the tokenizer files it keeps (``kept``: its
    tokenizer, special tokens, chat template and stop ids)."""
    if not isinstance(config.data, RecordsData) or kept is None:
        return {}
    return {name: kept / name for name in TOKENIZER_FILES if (kept / name).is_file()}


def _kept_here(run: Location, held: Path) -> Path | None:
    """The folder of the tokenizer ``run`` keeps, on this machine: its own where the run is
    local, else a copy of its files written into ``held``; None for a run that keeps none."""
    folder = kept_tokenizer.kept_folder(run)
    if folder is None:
        return None
    if folder.local_path is not None:
        return folder.local_path
    for name in folder.list_names():
        if (folder / name).is_file():
            (held / name).write_bytes((folder / name).read_bytes())
    return held


def _token_ids(own: LocalLocation | None, copies: dict[str, Path]) -> dict[str, Any]:
    """bos/eos ids: the run's own tokenizer's (``own``) document token, the source's ids, or
    those in the source's generation config."""
    if own is not None:
        from tokenizers import Tokenizer

        from trainrun.data.tokenizer import DOCUMENT_TOKEN

        token = Tokenizer.from_file(str(own)).token_to_id(DOCUMENT_TOKEN)
        if token is not None:  # each document starts with it: the model's bos and eos
            return {"bos_token_id": token, "eos_token_id": token}
    if GENERATION_CONFIG in copies:
        try:
            generation = json.loads(copies[GENERATION_CONFIG].read_text())
        except (OSError, ValueError):
            return {}
        return {k: generation[k] for k in ("bos_token_id", "eos_token_id") if k in generation}
    return {}


def _copy_tokenizer(copies: dict[str, Path], own: Path | None, to: Path) -> None:
    """The source's tokenizer files and generation config (``copies``: name -> the file to
    read); the run's own tokenizer.json (``own``) over them (it is what the run was trained
    with). Each is created new in ``to`` and never written through a link."""
    files = dict(copies)
    if own is not None:
        files["tokenizer.json"] = own
    for name, path in files.items():
        with path.open("rb") as read, create_new(to / name) as write:
            shutil.copyfileobj(read, write)
