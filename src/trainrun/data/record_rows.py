"""Record sources as packed rows: read as a stream, tokenized with a loss mask, packed, and kept
on disk, so a corpus larger than memory trains.

The records are read a chunk at a time (``CHUNK_RECORDS``); each chunk is encoded
(``examples.py``), packed (``documents.pack_documents``) and appended to one file per array
(``tokens``, ``segment_ids``, ``positions``, ``loss_mask``) in the cache
(``$TRAINRUN_CACHE_DIR/records/<key>``). Training then reads those files through memory maps:
batch ``i`` gathers its rows from them under the epoch's permutation (``ArrayBatches``), so the
whole corpus is shuffled, a batch is a function of ``i`` and the seed, a process reads only its
rows of each batch, and a run's data position is one index in its checkpoint. Host memory holds
one chunk while the cache is built and one batch (and the permutation, 8 bytes a row) while
training; the file pages the kernel keeps are cache it can drop.

The key names everything that decides the rows: the files (path, size, modification time), the
tokenizer and template, the data settings. Another run with the same ones reads the cache; a
process that finds it being built waits for it (a file lock), so processes on one machine build
it once.

Held-out split: ``data.eval_paths``, or every ``round(1 / eval_fraction)``-th usable record of
each source (a rule that needs no count of the records in advance).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import RecordsData
from trainrun.data import model_tokenizer
from trainrun.data.documents import pack_documents, row_index_dtype
from trainrun.data.examples import (
    Example,
    detect_format,
    encode_examples,
    problem,
    require_template,
)
from trainrun.data.pipeline import DataError
from trainrun.data.records import Located, read_records
from trainrun.data.tasks import task_records
from trainrun.data.text import corpus_files
from trainrun.errors import WriteFailed
from trainrun.platform.user_cache import cache_dir

CACHE_FORMAT = 1  # raised when the files' layout changes, so old caches are not read
CHUNK_RECORDS = 2048  # records encoded and packed at a time
SHOWN_BAD = 3  # bad records quoted in the counts
ARRAYS = ("tokens", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass
class RecordCounts:
    """What became of a source's records."""

    records: int = 0  # read, bad ones included
    examples: int = 0  # packed into rows (train and held out)
    skipped: int = 0  # bad records left out (data.bad_records=skip)
    cut: int = 0  # longer than a row: cut to it
    dropped: int = 0  # longer than a row: left out
    split: int = 0  # longer than a row: over several rows
    no_answer: int = 0  # nothing the loss counts (an empty answer, or one cut away)
    bad: list[str] = dataclasses.field(default_factory=list)  # the first few, "where: what"
    vocab: int = 0  # the tokenizer's ids run from 0 to vocab - 1

    def add(self, other: RecordCounts) -> None:
        for field in dataclasses.fields(self):
            if field.name == "bad":
                self.bad = (self.bad + other.bad)[:SHOWN_BAD]
            elif field.name == "vocab":
                self.vocab = max(self.vocab, other.vocab)
            else:
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def metrics(self) -> dict[str, float]:
        """The counts as metrics (``split: data`` in ``metrics.jsonl``)."""
        names = {"records": "records", "examples": "examples", "skipped": "skipped_records",
                 "cut": "cut_examples", "dropped": "dropped_examples",
                 "split": "split_examples", "no_answer": "no_answer_examples"}
        return {metric: float(getattr(self, name)) for name, metric in names.items()}

    def summary(self) -> str:
        """One line for the console."""
        parts = [f"{self.records} records -> {self.examples} examples"]
        for name, what in (("skipped", "bad records skipped"), ("cut", "cut to data.seq_len"),
                           ("dropped", "longer than data.seq_len dropped"),
                           ("split", "split over rows"),
                           ("no_answer", "left out with no answer tokens")):
            if getattr(self, name):
                parts.append(f"{getattr(self, name)} {what}")
        if self.bad:
            parts.append(f"first bad: {self.bad[0]}")
        return "; ".join(parts)


def record_splits(cfg: RecordsData) -> dict[str, Any]:
    """``{"train": arrays, "eval": arrays or None, "counts": RecordCounts}``; for ``data.mix``
    ``"train"`` is a list (one per source) beside ``"weights"``."""
    tokenizer = model_tokenizer.load(cfg.tokenizer or model_tokenizer.BYTES, cfg.chat_template)
    sources: list[Source] = (
        [Source(task=cfg.task)] if cfg.task else
        [Source(files=tuple(corpus_files(mix.source))) for mix in cfg.mix] or
        [Source(files=tuple(corpus_files(cfg.paths)))])
    held_out = (Source(files=tuple(corpus_files(cfg.eval_paths))) if cfg.eval_paths else None)
    every = 0 if held_out is not None or not cfg.eval_fraction else round(1 / cfg.eval_fraction)
    counts = RecordCounts(vocab=tokenizer.size)
    parts = []
    for source in sources:
        part = cached_rows(cfg, tokenizer, source, every)
        counts.add(part.counts)
        parts.append(part)
    if held_out is not None:
        part = cached_rows(cfg, tokenizer, held_out, -1)
        counts.add(part.counts)
        evals = [part.eval]
    else:
        evals = [part.eval for part in parts]
    for part, source in zip(parts, sources, strict=True):
        if part.train is None:
            raise DataError(f"no training examples in {source.describe()} ({part.counts.summary()}"
                            "); check data.format and data.fields against the records")
    found = [rows for rows in evals if rows is not None]
    held = (None if not found else found[0] if len(found) == 1 else
            {name: np.concatenate([rows[name] for rows in found]) for name in found[0]})
    if not cfg.mix:
        return {"train": parts[0].train, "eval": held, "counts": counts}
    return {"train": [part.train for part in parts],
            "weights": [mix.weight for mix in cfg.mix], "eval": held, "counts": counts}


@dataclasses.dataclass(frozen=True)
class Source:
    """Record files, or a synthetic task."""

    files: tuple[Path, ...] = ()
    task: str | None = None

    def describe(self) -> str:
        if self.task:
            return f"data.task={self.task}"
        shown = ", ".join(str(f) for f in self.files[:3])
        return shown + (f" and {len(self.files) - 3} more" if len(self.files) > 3 else "")

    def key(self) -> list[Any]:
        if self.task:
            return ["task", self.task]
        key: list[Any] = []
        for file in self.files:
            stat = file.stat()
            key.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
        return key

    def records(self, cfg: RecordsData) -> Iterator[Located]:
        if self.task:
            for i, record in enumerate(task_records(self.task, cfg.task_examples), 1):
                yield f"data.task={self.task} record {i}", record
            return
        columns = list(cfg.fields.model_dump().values())
        for file in self.files:
            yield from read_records(file, columns)


@dataclasses.dataclass
class Rows:
    train: dict[str, np.ndarray] | None
    eval: dict[str, np.ndarray] | None
    counts: RecordCounts


def cached_rows(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                every: int) -> Rows:
    """A source's rows from the cache, built first when missing. every: hold out each
    ``every``-th record (0: none; -1: all of them, a held-out source)."""
    settings = {"format": CACHE_FORMAT, "source": source.key(), "every": every,
                "tokenizer": tokenizer.fingerprint(), "seq_len": cfg.seq_len,
                "data": cfg.model_dump(mode="json", include={
                    "format", "fields", "loss", "bad_records", "too_long", "task_examples"})}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    root = cache_dir() / "records"
    folder = root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "a") as lock:  # one builder per machine
            fcntl.flock(lock, fcntl.LOCK_EX)
            rows = _open(folder)
            if rows is None:  # missing, or damaged: made anew
                shutil.rmtree(folder, ignore_errors=True)
                _build(cfg, tokenizer, source, every, folder)
                rows = _open(folder)
    except OSError as err:
        raise WriteFailed(f"cannot keep the tokenized records in {root} ({err.strerror or err}); "
                          "point TRAINRUN_CACHE_DIR at a writable directory") from None
    if rows is None:
        raise WriteFailed(f"the tokenized records written to {folder} do not read back; check "
                          "the disk, or point TRAINRUN_CACHE_DIR elsewhere")
    return rows


def _build(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
           every: int, folder: Path) -> None:
    """Write the rows of ``source`` into ``folder`` (whole or not at all: a temporary folder
    renamed into place)."""
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        counts = _write_rows(cfg, tokenizer, source, every, staging)
        rows = {split: _row_count(staging, split, cfg.seq_len + 1) for split in ("train", "eval")}
        manifest = {"row_len": cfg.seq_len + 1, "rows": rows,
                    "dtypes": _dtypes(tokenizer.size, cfg.seq_len + 1),
                    "counts": dataclasses.asdict(counts)}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
        os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _dtypes(vocab: int, row_len: int) -> dict[str, str]:
    index = np.dtype(row_index_dtype(row_len)).name
    return {"tokens": "uint16" if vocab <= 2**16 else "uint32", "segment_ids": index,
            "positions": index, "loss_mask": "uint8"}


def _row_count(folder: Path, split: str, row_len: int) -> int:
    file = folder / f"{split}.loss_mask.bin"
    return file.stat().st_size // row_len if file.exists() else 0


def _write_rows(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                every: int, folder: Path) -> RecordCounts:
    counts = RecordCounts()
    form: str | None = None if cfg.format == "auto" else cfg.format
    pending: dict[str, list[tuple[str, dict[str, Any]]]] = {"train": [], "eval": []}
    dtypes = _dtypes(tokenizer.size, cfg.seq_len + 1)
    usable = 0

    def refuse_or_skip(where: str, what: str) -> None:
        if cfg.bad_records == "refuse":
            raise DataError(f"record {where}: {what}; fix or remove it, or set "
                            "data.bad_records=skip to leave bad records out (they are counted)")
        counts.skipped += 1
        if len(counts.bad) < SHOWN_BAD:
            counts.bad.append(f"{where}: {what}")

    def flush(split: str) -> None:
        examples = _encode(pending[split], form or "text", cfg, tokenizer, refuse_or_skip)
        pending[split] = []
        kept = _fit(examples, cfg, counts)
        if not kept:
            return
        rows = pack_documents([ids.astype(dtypes["tokens"]) for ids, _ in kept],
                              cfg.seq_len + 1, masks=[mask for _, mask in kept])
        for name in ARRAYS:
            with open(folder / f"{split}.{name}.bin", "ab") as out:
                out.write(np.ascontiguousarray(rows[name], dtypes[name]).tobytes())

    for where, record in source.records(cfg):
        counts.records += 1
        if isinstance(record, str):
            refuse_or_skip(where, record)
            continue
        if form is None:
            form = detect_format(record, cfg.fields)
            if form is None:
                f = cfg.fields
                refuse_or_skip(where, f"has none of the fields {f.messages!r}, {f.prompt!r} and "
                                      f"{f.completion!r}, or {f.text!r} (set data.fields)")
                continue
        if form == "chat":
            require_template(tokenizer)
        what = problem(record, form, cfg.fields)
        if what is not None:
            refuse_or_skip(where, what)
            continue
        split = ("eval" if every == -1 or (every and usable % every == every - 1) else "train")
        usable += 1
        pending[split].append((where, record))
        if len(pending[split]) >= CHUNK_RECORDS:
            flush(split)
    for split in pending:
        if pending[split]:
            flush(split)
    return counts


def _encode(located: Sequence[tuple[str, dict[str, Any]]], form: str, cfg: RecordsData,
            tokenizer: model_tokenizer.ModelTokenizer,
            refuse_or_skip: Callable[[str, str], None]) -> list[Example]:
    """The records as examples; a chat record its template refuses (roles out of order, say)
    is a bad record."""
    examples = []
    encoded = encode_examples([record for _, record in located], form, cfg.fields, tokenizer,
                              cfg.loss)
    for (where, _), example in zip(located, encoded, strict=True):
        if isinstance(example, str):
            refuse_or_skip(where, example)
        else:
            examples.append(example)
    return examples


def _fit(examples: list[Example], cfg: RecordsData, counts: RecordCounts) -> list[Example]:
    """The examples that go into rows, after the ``too_long`` policy; each counted."""
    row_len = cfg.seq_len + 1
    kept = []
    for ids, mask in examples:
        if ids.size > row_len:
            if cfg.too_long == "drop":
                counts.dropped += 1
                continue
            if cfg.too_long == "cut":
                ids, mask = ids[:row_len], mask[:row_len]
                counts.cut += 1
            else:
                counts.split += 1
        if ids.size < 2 or not mask[1:].any():
            counts.no_answer += 1
            continue
        kept.append((ids, mask))
    counts.examples += len(kept)
    return kept


def _open(folder: Path) -> Rows | None:
    """The rows in ``folder``; None when it is missing or damaged."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        row_len, dtypes = manifest["row_len"], manifest["dtypes"]
        splits: dict[str, dict[str, np.ndarray] | None] = {}
        for split, rows in manifest["rows"].items():
            splits[split] = None if not rows else {
                name: _mapped(folder / f"{split}.{name}.bin", dtypes[name], rows, row_len)
                for name in ARRAYS}
        return Rows(train=splits["train"], eval=splits["eval"],
                    counts=RecordCounts(**manifest["counts"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _mapped(file: Path, dtype: str, rows: int, row_len: int) -> np.ndarray:
    """``[rows, row_len]`` of ``file``, read-only through a memory map. Batches read rows at
    random: the kernel is told so, or each row read would pull in its neighbours as well."""
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    array = np.frombuffer(mapped, dtype)
    if array.size != rows * row_len:
        raise ValueError(f"{file.name} holds {array.size} values, not {rows} x {row_len}")
    return array.reshape(rows, row_len)
