"""An export's folder (``trainrun export --to``): where an export may go, what ``--replace``
may replace, and how the new one is staged beside it and swapped in.

``--to`` is new, empty, or, with ``--replace``, a model directory: every entry in it is a
regular file of a name in ``REPLACEABLE`` (what an export, or ``save_pretrained`` of
transformers 5.x and peft, writes: a subfolder, a link or any other file makes it something
else) and weights among them. It is never at or inside a run directory, never the run being
exported or a folder holding it, and never at, inside or around anything the export reads (the
run's ``init.from`` chain, an adapter's base model, its tokenizer file). Anything else is
refused on one line naming what is in the way, before anything is read or written.

The export is written into a folder made for it beside the target,
``.<target>.export-<pid>-<hex>`` (``mkdir`` fails if the name exists, so nothing in it is a
link or a file placed in advance), and renamed into place; an old target is first renamed to
the same name plus ``.old`` and deleted once the new one is in place. A ``kill -9`` can leave
either folder behind: the next export to that target deletes those whose process (the pid in
the name) is gone from this host, after putting a ``.old`` back where the target is missing
(killed between the two renames), so the old export is never lost. A folder of a process that
is still running (an export in progress) is left alone.

On object storage (``--to gs://bucket/...`` or ``s3://...``), which has no rename, the export
is written in a local temporary folder and uploaded object by object under ``--to``, its mark
(``config.json``, or ``adapter_config.json``) last: a prefix without it is no whole export.
The same refusals hold there (a prefix inside a run, one holding a run or any object no export
writes); ``--replace`` deletes the old export's mark first, then writes the new objects,
deletes the old ones the new export does not have, and writes the new mark. A kill midway
leaves a prefix without a mark, which the next ``export --replace`` to it replaces.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

from trainrun.errors import UserError
from trainrun.models.huggingface import (
    CONFIG,
    GENERATION_CONFIG,
    INDEX,
    TOKENIZER_FILES,
    WEIGHTS,
)
from trainrun.models.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainrun.rundir import layout, ownership
from trainrun.storage import location
from trainrun.storage.location import Location

# Every file an export writes, and every file transformers 5.x's save_pretrained (model,
# tokenizer, generation config; safetensors only) and peft's (adapter, model card) write for
# a causal LM: a directory of these alone is a model directory --replace may replace.
REPLACEABLE = frozenset({CONFIG, GENERATION_CONFIG, WEIGHTS, INDEX, ADAPTER_CONFIG,
                         ADAPTER_WEIGHTS, "README.md", *TOKENIZER_FILES})
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # save_pretrained's sharded weights
WEIGHT_FILES = (WEIGHTS, INDEX, ADAPTER_WEIGHTS)
MARKS = (ADAPTER_CONFIG, CONFIG)  # written last on object storage: the export is whole


class ExportRefused(UserError):
    """A ``--to`` that export will not write to; the CLI prints it on one line and exits 2."""


def check_target(to: Path, replace: bool, run_dir: Location) -> None:
    """Refuse a ``--to`` (before the run is read) that is a file, at or inside a run
    directory, or a directory with files in it unless ``replace`` and it is a model directory
    that does not hold ``run_dir``."""
    if to.exists() and not to.is_dir():
        raise ExportRefused(f"--to {to} is a file, not a directory; give a directory for the "
                            "export (a new or empty one)")
    target = Path(os.path.realpath(to))
    run = ownership.enclosing_run(target)
    if run is not None:
        where = "is the" if run == target else "is inside the"
        raise ExportRefused(f"--to {to} {where} trainrun folder {run} (it has "
                            f"{layout.MARKER}): an export is never written into a run; give "
                            "a directory outside it")
    entries = sorted(target.iterdir(), key=lambda p: p.name) if target.is_dir() else []
    if not entries:
        return
    _refuse_holding_the_run(location.local(to), run_dir)
    _require_replaceable(to, replace, _shown(entries), _not_a_model_dir(to, entries))


def _refuse_holding_the_run(to: Location, run_dir: Location) -> None:
    if run_dir.real().is_relative_to(to.real()):
        raise ExportRefused(f"--to {to} holds the run being exported ({run_dir}); --replace "
                            "never deletes a run: give a new or empty directory outside it")


def _require_replaceable(to: object, replace: bool, shown: str,
                         why: str | None) -> None:
    """A ``--to`` that holds ``shown``: refused unless ``replace`` and it is a model
    directory (``why`` None, else what makes it none)."""
    if not replace:
        hint = ("pass --replace to replace it with this export, or give a new or empty "
                "directory" if why is None else "give a new or empty directory")
        raise ExportRefused(f"--to {to} is not empty (it holds {shown}); {hint}")
    if why is not None:
        raise ExportRefused(f"{why}: it is not a model directory, so --replace leaves it as it "
                            "is; give a new or empty directory, or an earlier export to replace")


def _not_a_model_dir(to: Path, entries: list[Path]) -> str | None:
    """What makes ``to`` (holding ``entries``) no model directory, or None if it is one."""
    foreign = [p for p in entries if not _replaceable(p)]
    if foreign:
        return f"--to {to} holds {_shown(foreign)}, which no export writes"
    if not any(p.name in WEIGHT_FILES or SHARD.fullmatch(p.name) for p in entries):
        return f"--to {to} holds {_shown(entries)} and no weights"
    return None


def check_reads(to: Location, reads: list[tuple[Location, str]]) -> None:
    """Refuse a ``--to`` that is, holds or lies inside a path the export reads; ``reads``:
    ``(path, what it is to the run)``, e.g. ``(llama, "the init.from of runs/sft")``."""
    target = to.real()
    for path, what in reads:
        real = path.real()  # a local path and an object are always apart
        if real == target:
            relation = f"is {what}"
        elif real.is_relative_to(target):
            relation = f"holds {path}, {what}"
        elif target.is_relative_to(real):
            relation = f"is inside {path}, {what}"
        else:
            continue
        raise ExportRefused(f"--to {to} {relation}: the export reads it, and never writes "
                            "over, into or around what it reads; give another directory")


def _replaceable(entry: Path) -> bool:
    return not entry.is_symlink() and entry.is_file() and _export_file(entry.name)


def _export_file(name: str) -> bool:
    return name in REPLACEABLE or SHARD.fullmatch(name) is not None


def _shown(entries: list[Path]) -> str:
    """Up to four entries: a folder as ``name/``, a link as ``name (a symbolic link)``."""
    def show(p: Path) -> str:
        if p.is_symlink():
            return f"{p.name} (a symbolic link)"
        return p.name + "/" if p.is_dir() else p.name
    return ", ".join(show(p) for p in entries[:4]) + (", ..." if len(entries) > 4 else "")


# ---- on object storage -----------------------------------------------------------------------


def check_remote_target(to: Location, replace: bool,
                        run_dir: Location) -> None:
    """``check_target`` for a ``--to`` on object storage: a prefix in a bucket that exists,
    not an object, not in or at a run, and empty unless ``replace`` and every object below it
    is one an export writes (weights among them)."""
    to.require_bucket("writing")
    if to.info() is not None:
        raise ExportRefused(f"--to {to} is an object, not a folder; give a prefix for the "
                            "export (a new or empty one)")
    run = _enclosing_remote_run(to)
    if run is not None:
        where = "is the" if str(run) == str(to) else "is inside the"
        raise ExportRefused(f"--to {to} {where} trainrun folder {run} (it has "
                            f"{layout.MARKER}): an export is never written into a run; give "
                            "a prefix outside it")
    objects = to.list_tree()
    if not objects:
        return
    _refuse_holding_the_run(to, run_dir)
    # the names right below --to: a folder (a key with more parts) as "name/"
    names = sorted({name.split("/", 1)[0] + ("/" if "/" in name else "") for name in objects})
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    foreign = [n for n in names if n.endswith("/") or not _export_file(n)]
    why = None
    if foreign:
        why = (f"--to {to} holds {', '.join(foreign[:4])}{', ...' * (len(foreign) > 4)}, "
               "which no export writes")
    elif not any(n in WEIGHT_FILES or SHARD.fullmatch(n) for n in names):
        why = f"--to {to} holds {shown} and no weights"
    _require_replaceable(to, replace, shown, why)


def _enclosing_remote_run(to: Location) -> Location | None:
    """``to`` or the nearest prefix above it in its bucket that holds a run's marker, or a
    ``config.yaml`` beside the status or provenance trainrun writes; None when none does."""
    folder = to
    while True:
        if (folder / layout.MARKER).is_file() or (
                (folder / layout.CONFIG).is_file()
                and ((folder / layout.STATUS).is_file()
                     or (folder / layout.PROVENANCE).is_file())):
            return folder
        if folder.parent == folder:  # the bucket itself
            return None
        folder = folder.parent


def publish(staging: Path, to: Location) -> None:
    """The export written in the local folder ``staging`` uploaded under ``to`` on object
    storage, each file as one object, the marks (``config.json``, ``adapter_config.json``)
    last; an old export there (checked replaceable) loses its marks first and, once the new
    files are up, the objects the new export does not have."""
    files = sorted(p.name for p in staging.iterdir())
    old = to.list_tree()
    for mark in MARKS:  # no longer whole from here until the new marks are up
        if mark in old:
            (to / mark).delete()
    for name in files:
        if name not in MARKS:
            (to / name).upload(staging / name)
    for name in sorted(set(old) - set(files) - set(MARKS)):
        (to / name).delete()
    for mark in MARKS:
        if mark in files:
            (to / mark).upload(staging / mark)


# ---- staging, the swap, and what a killed export left ----------------------------------------


def staging_dir(target: Path) -> Path:
    """A new folder beside ``target`` named for this process, where the export is written."""
    staging = target.with_name(f".{target.name}.export-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    return staging


def swap(staging: Path, target: Path) -> None:
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


def leftovers(target: Path) -> list[Path]:
    """The staging folders (and ``.old`` folders) beside ``target`` of exports to it whose
    process is gone from this host: real folders named exactly as ``staging_dir`` names them."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.export-(\d+)-[0-9a-f]{{8}}(\.old)?")
    found = []
    for entry in target.parent.iterdir() if target.parent.is_dir() else ():
        match = pattern.fullmatch(entry.name)
        if (match and entry.is_dir() and not entry.is_symlink()
                and not _alive(int(match.group(1)))):
            found.append(entry)
    return sorted(found, key=lambda p: p.name)


def restore_interrupted(target: Path) -> Path | None:
    """A killed export's old target put back where the target is missing (the kill came
    between moving it aside and renaming the new one in); returns what was put back."""
    if target.exists() or target.is_symlink():
        return None
    olds = [p for p in leftovers(target) if p.name.endswith(".old")]
    if not olds:
        return None
    newest = max(olds, key=lambda p: p.stat().st_mtime)
    newest.rename(target)
    return newest


def remove_leftovers(target: Path) -> list[Path]:
    """Delete what killed exports to ``target`` left beside it (see ``leftovers``)."""
    found = leftovers(target)
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True
