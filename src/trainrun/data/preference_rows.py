"""Preference records as packed pair rows, kept on disk as chat records' rows are
(``record_rows.py``): read as a stream (``records.py``), each record made a pair
(``preference_pairs.py``), packed (``pair_rows.py``) and appended to one file per array in the
cache (``$TRAINRUN_CACHE_DIR/records/<key>``, kept as ``storage/kept_files.py`` keeps files),
each file's sha256 in the manifest, checked as a run opens them: rows found damaged are made
anew, with a notice.

The key names everything that decides the rows: the files' content (path and sha256, or an
object's version), the tokenizer and template, the row length, the truncation lengths, the bad
records' policy, and whether each pair carries its record's ``margin`` (a reward model's). A
bad record (not JSON, no ``chosen``/``rejected``, messages out of order, two answers that are the
same tokens, a ``margin`` that is no number where one is read) is one line naming its file and
line (``data.bad_records=refuse``), or skipped and counted. A pair longer than a row is dropped
and counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import RecordsData
from trainrun.data import model_tokenizer
from trainrun.data.documents import row_index_dtype
from trainrun.data.errors import DataError
from trainrun.data.pair_rows import ARRAYS, LAYOUT, MARGIN, pack_pairs, pair_length
from trainrun.data.preference_pairs import PairCounts, PairForm, detect_form, encode_pairs
from trainrun.data.preference_pairs import problem as pair_problem
from trainrun.data.record_rows import CHUNK_RECORDS, SHOWN_BAD, RecordCounts, Source
from trainrun.data.text import corpus_files
from trainrun.platform.user_cache import cache_dir
from trainrun.storage import kept_files

CACHE_FORMAT = 2  # raised when the files' layout or counts change, so old rows are not read
OPEN_ROWS = 16  # rows open at a time while packing (first fit)


@dataclasses.dataclass(frozen=True)
class PairRows:
    """A source's pair rows (``pair_rows.ARRAYS``, each ``[rows, row_len]``) per split, where
    they are kept, what became of the records, and the notice of rows made anew."""

    train: dict[str, np.ndarray] | None
    eval: dict[str, np.ndarray] | None
    folder: Path
    counts: RecordCounts
    truncated: PairCounts
    notice: str | None = None


def preference_rows(cfg: RecordsData, max_prompt: int, max_completion: int,
                    margins: bool = False) -> tuple[PairRows, PairRows | None, dict[str, str]]:
    """The training source's rows (with every ``round(1 / eval_fraction)``-th usable record
    held out), the held-out files' rows (``data.eval_paths``; None without) and the content
    fingerprint of each file read. ``margins``: each pair carries its record's ``margin``
    (the rows' ``margin`` column)."""
    tokenizer = model_tokenizer.of_records(cfg)
    source = (Source(synthetic=cfg.synthetic) if cfg.synthetic else
              Source(files=tuple(corpus_files(cfg.paths))))
    every = 0 if cfg.eval_paths or not cfg.eval_fraction else round(1 / cfg.eval_fraction)
    train = kept_pair_rows(cfg, tokenizer, source, every, max_prompt, max_completion, margins)
    held = None
    files = dict(source.fingerprints())
    if cfg.eval_paths:
        held_source = Source(files=tuple(corpus_files(cfg.eval_paths)))
        held = kept_pair_rows(cfg, tokenizer, held_source, -1, max_prompt, max_completion,
                              margins)
        files.update(held_source.fingerprints())
    if train.train is None:
        fix = ("fix or replace the bad records (data.bad_records=skip left them out)"
               if train.counts.skipped else
               "check data.format and the records' prompt, chosen and rejected fields")
        raise DataError(f"no preference pairs to train on in {source.describe()} "
                        f"({train.counts.summary()}); {fix}")
    return train, held, files


def kept_pair_rows(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                   every: int, max_prompt: int, max_completion: int,
                   margins: bool = False) -> PairRows:
    """A source's pair rows from the cache, made first when missing or damaged
    (``storage/kept_files.py``). every: hold out each ``every``-th usable record (0: none; -1:
    all of them); margins: as ``preference_rows``'."""
    settings = {"format": CACHE_FORMAT, "kind": "preference", "layout": LAYOUT,
                "source": source.key(),
                "every": every, "tokenizer": tokenizer.fingerprint(), "seq_len": cfg.seq_len,
                "max_prompt": max_prompt, "max_completion": max_completion,
                "bad_records": cfg.bad_records, "examples": cfg.synthetic_examples,
                "fields": [cfg.fields.prompt, cfg.fields.chosen, cfg.fields.rejected]}
    if margins:  # only where asked: the keys of pairs without margins stay what they were
        settings["margin"] = True
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    folder = cache_dir() / "records" / key
    rows, notice = kept_files.kept(
        folder, "preference pairs", (*ARRAYS, MARGIN) if margins else ARRAYS,
        lambda manifest, splits: PairRows(
            train=splits["train"], eval=splits["eval"], folder=folder,
            counts=RecordCounts(**manifest["counts"]),
            truncated=PairCounts(**manifest["truncated"])),
        lambda staging: _build(cfg, tokenizer, source, every, (max_prompt, max_completion),
                               staging, margins))
    return dataclasses.replace(rows, notice=notice)


def _dtypes(vocab: int, row_len: int, margins: bool) -> dict[str, str]:
    index = np.dtype(row_index_dtype(row_len)).name
    return {"tokens": "uint16" if vocab <= 2**16 else "uint32", "segment_ids": index,
            "positions": index, "pair_slot": index, "branch": "uint8",
            "answer": "uint8", **({MARGIN: "int32"} if margins else {})}


def _build(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
           every: int, limits: tuple[int, int], folder: Path, margins: bool) -> dict[str, Any]:
    """The pair rows of ``source`` written into ``folder``; their manifest."""
    row_len = cfg.seq_len + 1
    files = kept_files.RowFiles(folder, _dtypes(tokenizer.size, row_len, margins), row_len)
    counts, truncated = _write_pairs(cfg, tokenizer, source, every, limits, files, margins)
    return files.manifest(counts=dataclasses.asdict(counts),
                          truncated=dataclasses.asdict(truncated))


def _write_pairs(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
                 every: int, limits: tuple[int, int], files: kept_files.RowFiles,
                 margins: bool) -> tuple[RecordCounts, PairCounts]:
    """Every usable record of ``source`` encoded, a chunk at a time, and written; what became
    of the records, and of their truncation."""
    chunks = _Chunks(cfg, tokenizer, limits, files, RecordCounts(vocab=tokenizer.size),
                     margins)
    for split, where, record in _usable(cfg, source, every, chunks.counts, chunks.forms,
                                        chunks.refuse_or_skip):
        chunks.pending[split].append((where, record))
        if len(chunks.pending[split]) >= CHUNK_RECORDS:
            chunks.flush(split)
    for split in chunks.pending:
        if chunks.pending[split]:
            chunks.flush(split)
    return chunks.counts, chunks.truncated


@dataclasses.dataclass
class _Chunks:
    """Records waiting to be encoded, per split, and what became of those encoded."""

    cfg: RecordsData
    tokenizer: model_tokenizer.ModelTokenizer
    limits: tuple[int, int]  # max_prompt, max_completion
    files: kept_files.RowFiles
    counts: RecordCounts
    margins: bool = False  # each pair carries its record's margin
    truncated: PairCounts = dataclasses.field(default_factory=PairCounts)
    forms: list[PairForm] = dataclasses.field(default_factory=list)  # the first record's
    pending: dict[str, list[tuple[str, dict[str, Any]]]] = dataclasses.field(
        default_factory=lambda: {"train": [], "eval": []})

    def refuse_or_skip(self, where: str, what: str) -> None:
        if self.cfg.bad_records == "refuse":
            raise DataError(f"record {where}: {what}; fix or remove it, or set "
                            "data.bad_records=skip to leave bad records out (they are counted)")
        self.counts.skipped += 1
        if len(self.counts.bad) < SHOWN_BAD:
            self.counts.bad.append(f"{where}: {what}")

    def flush(self, split: str) -> None:
        """The split's pending records encoded; the pairs that fit a row written."""
        located, self.pending[split] = self.pending[split], []
        encoded = encode_pairs([record for _, record in located], self.forms[0],
                               self.tokenizer, *self.limits, self.truncated, self.margins)
        kept = []
        for (where, _), pair in zip(located, encoded, strict=True):
            if isinstance(pair, str):
                self.refuse_or_skip(where, _as_named(pair, _field_names(self.cfg)))
            elif pair_length(pair) > self.files.row_len:
                self.counts.dropped += 1
            else:
                kept.append(pair)
        if split == "eval":
            self.counts.held_examples += len(kept)
        else:
            self.counts.examples += len(kept)
        if kept:  # packed into rows, each array appended to its file
            self.files.append(split, pack_pairs(kept, self.files.row_len, OPEN_ROWS)[0])


def _usable(cfg: RecordsData, source: Source, every: int, counts: RecordCounts,
            forms: list[PairForm], refuse_or_skip: Callable[[str, str], None],
            ) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(split, where, record)`` for each usable record, in order; the first one's form is
    every record's (``forms[0]``), a record of another form is a bad one."""
    usable = 0
    named = _field_names(cfg)
    fields = [cfg.fields.chosen, cfg.fields.rejected]
    for where, record in source.records(cfg):
        counts.records += 1
        if isinstance(record, str):
            refuse_or_skip(where, record)
            continue
        record = _renamed(record, named)
        form = detect_form(record)
        if form is None:
            refuse_or_skip(where, f"has no {fields[0]!r} and {fields[1]!r} fields (its "
                                  f"fields: {', '.join(sorted(record)) or 'none'})")
            continue
        forms[:] = forms or [form]
        what = (pair_problem(record, form) if form == forms[0] else
                f"a {form} pair where the records before it are {forms[0]} pairs")
        if what is not None:
            refuse_or_skip(where, _as_named(what, named))
            continue
        split = "eval" if every == -1 or (every and usable % every == every - 1) else "train"
        usable += 1
        if split == "eval":  # counted apart from the records that train
            counts.records -= 1
            counts.held_records += 1
        yield split, where, record


def _field_names(cfg: RecordsData) -> dict[str, str]:
    """The record fields ``data.fields`` names for a pair's parts, each with its part's name."""
    return {cfg.fields.prompt: "prompt", cfg.fields.chosen: "chosen",
            cfg.fields.rejected: "rejected"}


def _renamed(record: dict[str, Any], named: dict[str, str]) -> dict[str, Any]:
    """``record`` with the fields ``data.fields`` names for a pair under the names a pair's
    parts go by (``prompt``, ``chosen``, ``rejected``); as it is under the default names."""
    if all(given == part for given, part in named.items()):
        return record
    kept = {name: value for name, value in record.items()
            if name not in named and name not in named.values()}
    return {**kept, **{part: record[given] for given, part in named.items() if given in record}}


def _as_named(what: str, named: dict[str, str]) -> str:
    """A problem found in a renamed record, naming its fields as the record does."""
    for given, part in named.items():
        what = what.replace(f"'{part}'", f"'{given}'")
    return what
