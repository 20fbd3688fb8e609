"""Checksums of a checkpoint's files: written when a step is saved, verified before it is read.

Orbax stores arrays through TensorStore (zarr chunks in an OCDBT database) without a checksum of
their data: zarr3's crc32c covers only a shard's index and OCDBT's only its tree nodes, so bytes
flipped inside an array file read back as other numbers. Each item directory of a step
(``state/``, ``data/``, ``meta/``) therefore gets ``trainrun-checksums.json``: the sha256 and
size of every file in it. The item's handler writes it in ``finalize``, which Orbax calls on
process 0 once every process has written its files and before it renames the step to its
committed name, so a committed step always has its checksums.

Verification reads every file of a step and compares: a changed, missing or unlisted file makes
the step unreadable (the caller falls back to the step before). Orbax's record of the step
(``_CHECKPOINT_METADATA``), written after the checksums, is checked by reading it as Orbax does:
one it cannot read is damage ``verify-checkpoint`` reports, and one a resume rewrites, since
reading the step's files does not need it (``checkpoints.repair_step_metadata``). A step
without any checksum file was written by a trainrun from before them; it is restored
unverified, and said so. A step on object storage is listed and read through the storage layer
(``storage.location``) alike; its record also keeps the store's own checksum of each object,
which a restore compares from one listing instead of reading every byte twice
(``verify-checkpoint`` still reads them all).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

from trainrun.storage import location
from trainrun.storage.location import Location

MANIFEST = "trainrun-checksums.json"
ITEMS = ("state", "data", "meta")
STEP_RECORD = "_CHECKPOINT_METADATA"  # Orbax's record of a step, written as it commits
# Orbax's own commit marks, written after the items are finalized (so after the checksums).
ORBAX_MARKS = frozenset({"commit_success.txt", STEP_RECORD})
BLOCK = 1 << 20  # bytes hashed at a time: a file of any size in little memory
# A large object's ranged reads: their size and how many at once, what one file holds in memory
# while it is hashed (BENCHMARKS.md, "Object storage").
RANGE, RANGES_AT_ONCE = 32 << 20, 4


def file_digest(path: Location, size: int | None = None) -> str:
    """The sha256 of a file, streamed; one whose ``size`` is given (an object on object
    storage, each read a round trip) is read as ranges several at a time, hashed in order."""
    digest = hashlib.sha256()
    if size is not None and size > RANGE:
        starts = range(0, size, RANGE)
        with ThreadPoolExecutor(RANGES_AT_ONCE) as pool:
            for block in pool.map(lambda a: path.read_range(a, min(a + RANGE, size)),
                                  starts):
                digest.update(block)
        return digest.hexdigest()
    with path.open_read() as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


REMOTE_READERS = 8  # small files hashed at once on object storage: each read is a round trip


def digests(directory: Location, sizes: dict[str, int]) -> dict[str, str]:
    """``{name: sha256}`` of files below ``directory`` (of the given sizes): one after another
    locally, several at once on object storage."""
    at_once = directory.local_path is None  # each read a round trip to the store
    small = [name for name in sizes if at_once and sizes[name] <= RANGE]
    found = {}
    if len(small) > 1:  # several at once; a large one alone, its ranges several at once
        with ThreadPoolExecutor(min(REMOTE_READERS, len(small))) as pool:
            found = dict(zip(small, pool.map(
                lambda name: file_digest(directory / name, sizes[name]), small), strict=True))
    # the store asked once here, not again for each file
    return {name: found.get(name) or file_digest(directory / name,
                                                 sizes[name] if at_once else None)
            for name in sizes}


def write_manifest(directory: Location | os.PathLike[str]) -> None:
    """The checksums of every file under ``directory`` (an item being finalized), local or on
    object storage."""
    directory = location.location(directory)  # as Orbax hands it over
    sizes = {name: size for name, size in directory.list_tree().items()
             if name.rsplit("/", 1)[-1] not in ORBAX_MARKS | {MANIFEST}}
    hashed = digests(directory, sizes)
    files: dict[str, dict[str, object]] = {name: {"sha256": hashed[name], "bytes": size}
                                           for name, size in sizes.items()}
    # what a restore compares on object storage, reading no byte (see below); none locally
    for name, checksum in directory.content_checksums().items():
        if name in files:
            files[name]["store"] = checksum
    (directory / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1))


@dataclasses.dataclass
class Verified:
    """One step's verification: ``problems`` empty means every file matches its checksum;
    ``checked`` is False for a step saved without checksums (nothing to compare)."""

    problems: list[str]
    checked: bool
    files: int = 0
    bytes: int = 0


def verify_step(step_dir: Location | str | os.PathLike[str], *, read: bool = True) -> Verified:
    """Compare every file of the step at ``step_dir`` with the checksums saved with it.

    On object storage with ``read=False`` (a restore), a file whose saved record holds the
    store's own checksum of it is compared by that alone, from one listing: the store computed
    it from the bytes it was given and keeps its data checked itself, so an object changed or
    written again since the save shows another. ``read=True`` (``verify-checkpoint``) reads and
    hashes every byte."""
    step_dir = location.location(step_dir)  # a path given here enters here
    items = [step_dir / name for name in ITEMS if (step_dir / name).is_dir()]
    if not any((item / MANIFEST).exists() for item in items):
        return Verified([], checked=False)
    result = Verified([], checked=True)
    for item in items:
        result.problems += _verify_item(item, result, read)
    return result


def _verify_item(item: Location, result: Verified, read: bool = True) -> list[str]:
    try:
        listed = json.loads((item / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return [f"{item.name}/ has no {MANIFEST}"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{item.name}/{MANIFEST} cannot be read ({type(err).__name__})"]
    problems = []
    present = {name: size for name, size in item.list_tree().items()
               if name.rsplit("/", 1)[-1] not in ORBAX_MARKS | {MANIFEST}}
    stored = {} if read else item.content_checksums()
    by_store = {name for name, saved in listed.items()
                if saved.get("store") and name in stored}
    hashed = digests(item, {name: saved["bytes"] for name, saved in listed.items()
                            if present.get(name) == saved["bytes"] and name not in by_store})
    for name, saved in listed.items():
        where = f"{item.name}/{name}"
        size = present.pop(name, None)
        if size is None:
            problems.append(f"{where} is missing")
            continue
        result.files += 1
        result.bytes += size
        if size != saved["bytes"]:
            problems.append(f"{where} has {size} bytes, {saved['bytes']} when saved")
            continue
        if name in by_store:
            if stored[name] != saved["store"]:
                problems.append(f"checksum mismatch in {where} (the store's {stored[name]}, "
                                f"saved {saved['store']})")
            continue
        digest = hashed[name]
        if digest != saved["sha256"]:
            problems.append(f"checksum mismatch in {where} (sha256 {digest[:12]}, saved "
                            f"{saved['sha256'][:12]})")
    problems += [f"{item.name}/{name} is not in the saved checksums" for name in present]
    return problems


def step_record_problem(step_dir: Location) -> str | None:
    """Why Orbax cannot read its record of the step at ``step_dir`` (``_CHECKPOINT_METADATA``:
    the step's item handlers, timestamps and metrics, written as the step commits, after the
    checksums and so outside them), read through the storage layer and checked by Orbax's
    own deserializer; None when it reads, or when there is none (Orbax then goes without)."""
    try:
        record = json.loads((step_dir / STEP_RECORD).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # not UTF-8 text, or not JSON
        return f"{STEP_RECORD}, Orbax's record of step {step_dir.name}, is not JSON ({err})"
    # what Orbax's get_step_metadata runs on the file's JSON (no public name for it alone)
    from orbax.checkpoint._src.metadata import step_metadata_serialization

    try:
        step_metadata_serialization.deserialize(record)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        return (f"{STEP_RECORD}, Orbax's record of step {step_dir.name}, is not one Orbax "
                f"reads ({err})").replace("\n", " ")
    return None


def verify_run_checkpoint(run_dir: Location | str,
                          step: int | None = None) -> tuple[bool, str]:
    """``trainrun verify-checkpoint``: the checksums of one committed step of a run (default
    its newest), without training. Returns (every file matches, a line saying what was found)."""
    from trainrun.errors import UserError
    from trainrun.rundir import CHECKPOINTS, CONFIG, committed_steps, read_yaml

    run = location.location(run_dir)
    if not (run / CONFIG).is_file():
        run.require_bucket()
        raise UserError(f"{run} holds no trainrun run (no {CONFIG}); give a run directory")
    section = read_yaml(run / CONFIG).get("checkpoint")
    ckpt = section.get("dir") if isinstance(section, dict) else None
    ckpt_dir = location.location(ckpt) if ckpt else run / CHECKPOINTS
    steps = committed_steps(ckpt_dir)
    if not steps:
        raise UserError(f"{ckpt_dir} holds no committed checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise UserError(f"{ckpt_dir} has no checkpoint of step {step}; its steps: "
                        f"{', '.join(map(str, steps))}")
    where = ckpt_dir / str(step)
    result = verify_step(where)
    record = step_record_problem(where)
    if record is not None:  # the files may still match: resuming rewrites the record
        result.problems.append(f"{record}; resuming the run rewrites it")
    if result.problems:
        return False, f"{where}: " + "; ".join(result.problems)
    if not result.checked:
        return False, (f"{where} has no checksums (saved by a trainrun from before them): "
                       "nothing to verify it against")
    return True, (f"{where}: {result.files} files, {result.bytes:,} bytes: every checksum "
                  "matches")
