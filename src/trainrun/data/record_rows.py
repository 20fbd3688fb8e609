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

The key names everything that decides the rows: the files (path and the sha256 of their bytes;
for an object on ``gs://`` or ``s3://``, its URL and the version and size the store gives it:
``_object_identity``), the tokenizer and template, the data settings. The rows are kept on
local disk whatever the files' location. Another run with the same ones reads the cache; a
process that finds it being built waits for it (a file lock), so processes on one machine build
it once. The files' bytes, not their size and modification time: a file rewritten with other
records of the same size and time (``cp -p``, ``rsync -t``) is another key, while one touched or
copied unchanged keeps its rows. Each start reads the files once to hash them (streamed, a block
at a time; ``BENCHMARKS.md`` has the cost), as it reads the kept rows to check them.

The rows are kept as ``storage/kept_files.py`` keeps files: each file's sha256 in the folder's
manifest, computed as it is written and checked as a run opens it (read through once, a block
at a time, before it is mapped); rows changed in place or cut short, by a disk or a hand, are
made anew, with a one-line notice (``Rows.notice``) that the run prints; a cache directory that
cannot take them (full, read-only, not permitted) is one line naming it, exit 1.

Held-out split: ``data.eval_paths``, or every ``round(1 / eval_fraction)``-th usable record of
each source (a rule that needs no count of the records in advance).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import RecordsData
from trainrun.data import model_tokenizer
from trainrun.data.documents import pack_documents, row_index_dtype
from trainrun.data.errors import DataError
from trainrun.data.examples import (
    Example,
    detect_format,
    encode_examples,
    problem,
    require_template,
)
from trainrun.data.records import Located, read_records
from trainrun.data.tasks import task_records
from trainrun.data.text import corpus_files
from trainrun.platform.user_cache import cache_dir
from trainrun.storage import kept_files, location

Location = location.Location  # a local path, or a gs:// or s3:// one

CACHE_FORMAT = 3  # raised when the files' layout or counts change, so old caches are not read
CHUNK_RECORDS = 2048  # records encoded and packed at a time
SHOWN_BAD = 3  # bad records quoted in the counts
ARRAYS = ("tokens", "segment_ids", "positions", "loss_mask")
WHAT = "tokenized records"  # what the cache's notices and refusals call the rows


@dataclasses.dataclass
class RecordCounts:
    """What became of a source's records."""

    records: int = 0  # read, bad ones included, held-out ones not
    examples: int = 0  # packed into training rows
    held_records: int = 0  # usable records held out for evaluation
    held_examples: int = 0  # held-out records packed into eval rows
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
        names = {"records": "records", "examples": "examples",
                 "held_records": "held_out_records", "held_examples": "held_out_examples",
                 "skipped": "skipped_records",
                 "cut": "cut_examples", "dropped": "dropped_examples",
                 "split": "split_examples", "no_answer": "no_answer_examples"}
        return {metric: float(getattr(self, name)) for name, metric in names.items()}

    def summary(self) -> str:
        """One line for the console: what trains, then what is held out."""
        parts = [f"{self.records} records -> {self.examples} examples{self._held()}"]
        for name, what in (("skipped", "bad records skipped"), ("cut", "cut to data.seq_len"),
                           ("dropped", "longer than data.seq_len dropped"),
                           ("split", "split over rows"),
                           ("no_answer", "left out with no answer tokens")):
            if getattr(self, name):
                parts.append(f"{getattr(self, name)} {what}")
        if self.bad:
            parts.append(f"first bad: {self.bad[0]}")
        return "; ".join(parts)

    def _held(self) -> str:
        if not self.held_records:
            return ""
        if self.held_examples == self.held_records:
            return f" ({self.held_records} held out)"
        return f" ({self.held_records} held out -> {self.held_examples} examples)"


def record_splits(cfg: RecordsData) -> dict[str, Any]:
    """``{"train": arrays, "eval": arrays or None, "counts": RecordCounts, "notices": lines,
    "files": fingerprints}`` (``notices``: kept rows found damaged and made anew; ``files``:
    each record file read, with ``Source.fingerprints``); for ``data.mix`` ``"train"`` is a
    list (one per source) beside ``"weights"``."""
    tokenizer = model_tokenizer.of_records(cfg)
    sources: list[Source] = (
        [Source(synthetic=cfg.synthetic)] if cfg.synthetic else
        [Source(files=tuple(corpus_files(mix.source))) for mix in cfg.mix] or
        [Source(files=tuple(corpus_files(cfg.paths)))])
    held_out = (Source(files=tuple(corpus_files(cfg.eval_paths))) if cfg.eval_paths else None)
    every = 0 if held_out is not None or not cfg.eval_fraction else round(1 / cfg.eval_fraction)
    counts = RecordCounts(vocab=tokenizer.size)
    parts = [cached_rows(cfg, tokenizer, source, every) for source in sources]
    held = [] if held_out is None else [cached_rows(cfg, tokenizer, held_out, -1)]
    for part in (*parts, *held):
        counts.add(part.counts)
    evals = [part.eval for part in held or parts]
    for part, source in zip(parts, sources, strict=True):
        if part.train is None:
            raise DataError(f"no training examples in {source.describe()} ({part.counts.summary()}"
                            "); check data.format and data.fields against the records")
    found = [rows for rows in evals if rows is not None]
    eval_rows = (None if not found else found[0] if len(found) == 1 else
                 {name: np.concatenate([rows[name] for rows in found]) for name in found[0]})
    notices = [part.notice for part in (*parts, *held) if part.notice]
    files = {name: found for source in (*sources, *([held_out] if held_out else []))
             for name, found in source.fingerprints().items()}
    if not cfg.mix:
        return {"train": parts[0].train, "eval": eval_rows, "counts": counts, "notices": notices,
                "files": files}
    return {"train": [part.train for part in parts],
            "weights": [mix.weight for mix in cfg.mix], "eval": eval_rows, "counts": counts,
            "notices": notices, "files": files}


@dataclasses.dataclass(frozen=True)
class Source:
    """Record files, or a synthetic task."""

    files: tuple[Location, ...] = ()
    synthetic: str | None = None

    def describe(self) -> str:
        if self.synthetic:
            return f"data.synthetic={self.synthetic}"
        shown = ", ".join(str(f) for f in self.files[:3])
        return shown + (f" and {len(self.files) - 3} more" if len(self.files) > 3 else "")

    def key(self) -> list[Any]:
        if self.synthetic:
            return ["task", self.synthetic]  # the key kept rows were made under: still valid
        return self._identities

    @functools.cached_property
    def _identities(self) -> list[list[Any]]:
        """Each file's identity, asked of it once: its resolved path and the sha256 of its
        bytes, or an object's ``_object_identity``."""
        return [_object_identity(file) if file.local_path is None else
                [str(file.local_path.resolve()), _content_digest(file.local_path)]
                for file in self.files]

    def fingerprints(self) -> dict[str, str]:
        """Each file by its name, with its content fingerprint: ``sha256:<hex>`` of a local
        file's bytes, or ``<version> <size>`` as the store gives them for an object."""
        if self.synthetic:
            return {}
        return {str(file): (f"version {identity[2]}, {identity[3]} bytes"
                            if identity[1] == "version" else f"sha256:{identity[1]}")
                for file, identity in zip(self.files, self._identities, strict=True)}

    def records(self, cfg: RecordsData) -> Iterator[Located]:
        if self.synthetic:
            for i, record in enumerate(task_records(self.synthetic, cfg.synthetic_examples), 1):
                yield f"data.synthetic={self.synthetic} record {i}", record
            return
        columns = (["prompt", "chosen", "rejected"] if cfg.format == "preference" else
                   list(cfg.fields.model_dump().values()))
        for file in self.files:
            yield from read_records(file, columns)


def _object_identity(file: Location) -> list[Any]:
    """What identifies the content of an object on ``gs://`` or ``s3://``: the version the store
    gave its last write (GCS: its generation; S3: its ETag) and its size, asked of the store
    without reading the bytes. Different bytes never keep the version: every write of a GCS
    object gets a new generation, and an S3 ETag is a digest of the content (the MD5 of the
    bytes, or of its parts' MD5s for a multipart upload), which the size then backs. The same
    bytes written again keep an S3 ETag but get a new GCS generation: at worst the rows are
    made again."""
    try:
        name, size, version = file.identity()
    except FileNotFoundError:
        raise DataError(f"data.paths: {file.missing_line('object')}; it was listed but "
                        "is gone: run again once the data stops changing") from None
    return [name, "version", version, size]


def _content_digest(file: Path) -> str:
    """The sha256 of a file's bytes, read a block at a time."""
    try:
        with open(file, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as err:
        raise DataError(f"data.paths: cannot read {str(file)!r} ({err.strerror or err}); "
                        "check the file and its permissions") from None


@dataclasses.dataclass
class Rows:
    train: dict[str, np.ndarray] | None
    eval: dict[str, np.ndarray] | None
    counts: RecordCounts
    notice: str | None = None  # kept rows were damaged and made anew: what the run says


def cached_rows(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                every: int) -> Rows:
    """A source's rows from the cache, built first when missing or damaged
    (``storage/kept_files.py``). every: hold out each ``every``-th record (0: none; -1: all of
    them, a held-out source)."""
    settings = {"format": CACHE_FORMAT, "source": source.key(), "every": every,
                "tokenizer": tokenizer.fingerprint(), "seq_len": cfg.seq_len,
                "data": {**cfg.model_dump(mode="json", include={
                    "format", "fields", "loss", "bad_records", "too_long"}),
                    # under its name when the rows were first kept: they stay valid
                    "task_examples": cfg.synthetic_examples}}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    rows, notice = kept_files.kept(
        cache_dir() / "records" / key, WHAT, ARRAYS,
        lambda manifest, splits: Rows(train=splits["train"], eval=splits["eval"],
                                      counts=RecordCounts(**manifest["counts"])),
        lambda staging: _build(cfg, tokenizer, source, every, staging))
    return dataclasses.replace(rows, notice=notice)


def _build(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
           every: int, folder: Path) -> dict[str, Any]:
    """The rows of ``source`` written into ``folder``; their manifest."""
    files = kept_files.RowFiles(folder, _dtypes(tokenizer.size, cfg.seq_len + 1), cfg.seq_len + 1)
    counts = _write_rows(cfg, tokenizer, source, every, files)
    return files.manifest(counts=dataclasses.asdict(counts))


def _dtypes(vocab: int, row_len: int) -> dict[str, str]:
    index = np.dtype(row_index_dtype(row_len)).name
    return {"tokens": "uint16" if vocab <= 2**16 else "uint32", "segment_ids": index,
            "positions": index, "loss_mask": "uint8"}


def _write_rows(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                every: int, files: kept_files.RowFiles) -> RecordCounts:
    """The rows' files written (``files``); what became of the records."""
    counts = RecordCounts()
    form: str | None = None if cfg.format == "auto" else cfg.format
    pending: dict[str, list[tuple[str, dict[str, Any]]]] = {"train": [], "eval": []}

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
        kept = _fit(examples, cfg, counts, split)
        if kept:  # packed into rows, each array appended to its file
            files.append(split, pack_documents(
                [ids.astype(files.dtypes["tokens"]) for ids, _ in kept], files.row_len,
                masks=[mask for _, mask in kept]))

    for split, where, record, found in split_records(cfg, tokenizer, source, every, counts,
                                                     refuse_or_skip):
        form = found
        pending[split].append((where, record))
        if len(pending[split]) >= CHUNK_RECORDS:
            flush(split)
    for split in pending:
        if pending[split]:
            flush(split)
    return counts


def split_records(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                  every: int, counts: RecordCounts | None = None,
                  refuse_or_skip: Callable[[str, str], None] = lambda where, what: None,
                  ) -> Iterator[tuple[str, str, dict[str, Any], str]]:
    """``(split, where, record, format)`` for each usable record of ``source``, in order:
    every ``every``-th one held out (``"eval"``; -1: all of them, 0: none), the others
    ``"train"``; a record that is not usable goes to ``refuse_or_skip``."""
    form: str | None = None if cfg.format == "auto" else cfg.format
    usable = 0
    for where, record in source.records(cfg):
        if counts is not None:
            counts.records += 1
        if isinstance(record, str):
            refuse_or_skip(where, record)
            continue
        if form is None:
            form = detect_format(record, cfg.fields)
            if form is None:
                f = cfg.fields
                pair = "chosen" in record and "rejected" in record
                refuse_or_skip(where, "is a preference pair: set data.format=preference" if pair
                               else f"has none of the fields {f.messages!r}, {f.prompt!r} and "
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
        if counts is not None and split == "eval":  # counted apart from the records that train
            counts.records -= 1
            counts.held_records += 1
        yield split, where, record, form


def held_out_sources(cfg: RecordsData) -> list[tuple[Source, int]]:
    """The sources whose held-out records the eval split holds, each with its ``every``
    (as ``split_records`` takes it)."""
    if cfg.eval_paths:
        return [(Source(files=tuple(corpus_files(cfg.eval_paths))), -1)]
    every = round(1 / cfg.eval_fraction) if cfg.eval_fraction else 0
    if cfg.synthetic:
        return [(Source(synthetic=cfg.synthetic), every)]
    return [(Source(files=tuple(corpus_files(mix.source))), every) for mix in cfg.mix] or [
        (Source(files=tuple(corpus_files(cfg.paths))), every)]


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


def _fit(examples: list[Example], cfg: RecordsData, counts: RecordCounts,
         split: str) -> list[Example]:
    """The examples of ``split`` that go into rows, after the ``too_long`` policy; each
    counted."""
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
    if split == "eval":
        counts.held_examples += len(kept)
    else:
        counts.examples += len(kept)
    return kept
