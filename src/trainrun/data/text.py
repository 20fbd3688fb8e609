"""Text files as a language-model corpus.

The files a set of glob patterns match are read in sorted order and joined into one byte stream;
the last ``eval_fraction`` of it is held out. As bytes, each example is a window of
``seq_len + 1`` bytes (inputs plus the next byte to predict) starting at a multiple of
``seq_len``. As documents (``split_documents``), each file is one, tokenized and packed into
rows (``packed_sources``: ``tokenizer.py``, ``documents.py``); the held-out split is then the
very same bytes.

``data.paths`` (and each source of ``data.mix``) may name ``gs://bucket/...`` and
``s3://bucket/...`` objects, globs included (``gs://b/corpus/*.txt``), read through the
storage layer (``storage/remote.py``): the patterns are matched by the store's listing and each
object read whole into memory, as a local file is.

The default corpus is the ``.py`` files of the running Python's standard library (installed
packages excluded): real code present on every machine. It differs between Python versions
(each release adds, removes and edits modules), so byte counts and losses differ slightly too.
"""

from __future__ import annotations

import glob
import hashlib
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainrun.data.errors import DataError
from trainrun.data.pipeline import token_windows
from trainrun.storage import location

Location = location.Location

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_patterns() -> tuple[str, ...]:
    return (str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"),)


def corpus_files(patterns: Sequence[str]) -> list[Location]:
    """The files the patterns match (``**`` recurses), sorted and without duplicates: local
    paths, then objects of ``gs://`` and ``s3://`` patterns (matched by the store's listing)."""
    found: set[Location] = set()
    for pattern in patterns:
        where = location.location(pattern)  # one naming no bucket, or no client: one line
        files = [f for f in where.matches() if not EXCLUDED_DIRS & set(str(f).split("/"))]
        if not files:
            raise DataError(_no_match(where, pattern))
        found.update(files)
    # local files first, in path order, then objects by name
    return sorted(found, key=lambda f: (f.local_path is None, f.local_path or Path(), str(f)))


def _no_match(where: Location, pattern: str) -> str:
    if where.local_path is not None:
        return (f"data.paths pattern {pattern!r} matches no files; check the path (use ** to "
                "search subdirectories)")
    missing = where.missing_line("object")  # no bucket: its own line
    if not glob.has_magic(pattern):
        return f"data.paths: {missing}; check the bucket and the path"
    return (f"data.paths pattern {pattern!r} matches no objects; check the bucket and the path "
            "(use ** to search below prefixes)")


def read_file(path: Location) -> bytes:
    """A corpus file's bytes, local or on object storage (one that went away after it was
    listed is one line)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if path.local_path is not None:
            raise
        raise DataError(f"data.paths: {path} is no longer there (deleted after it was "
                        "listed); run again once the data stops changing") from None


def read_files(patterns: Sequence[str], files: dict[str, str] | None = None) -> list[bytes]:
    """The bytes of each file the patterns match, in order; ``files``, when given, gets each
    file's name with the sha256 of the bytes read (``sha256:<hex>``)."""
    blobs = []
    for path in corpus_files(patterns):
        blob = read_file(path)
        if files is not None:
            files[str(path)] = f"sha256:{hashlib.sha256(blob).hexdigest()}"
        blobs.append(blob)
    return blobs


def read_corpus(patterns: Sequence[str], files: dict[str, str] | None = None) -> np.ndarray:
    """The matched files' bytes, joined, as a uint8 array (``files``: as ``read_files``)."""
    return np.frombuffer(b"".join(read_files(patterns, files)), np.uint8)


def text_arrays(cfg, patterns: Sequence[str] = (),
                files: dict[str, str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """``{"train": {"tokens"}, "eval": {"tokens"}}``: windows ``[N, seq_len + 1]`` uint8 of the
    files ``patterns`` match (default: ``data.paths``, else the standard library);
    ``files``: as ``read_files``."""
    patterns = patterns or cfg.paths or stdlib_patterns()
    stream = read_corpus(patterns, files)
    if stream.size == 0:
        raise DataError(f"the text corpus {list(patterns)} is empty (0 bytes); point data.paths "
                        "at files with text in them")
    held_out = int(stream.size * cfg.eval_fraction)
    train, held = stream[:stream.size - held_out], stream[stream.size - held_out:]
    return {"train": {"tokens": token_windows(train, cfg.seq_len, "the training text")},
            "eval": {"tokens": token_windows(held, cfg.seq_len, "the held-out text",
                                             strict=False)}}


def split_documents(patterns: Sequence[str], eval_fraction: float,
                    files: dict[str, str] | None = None) -> tuple[list[bytes], list[bytes]]:
    """The matched files as documents, split as ``text_arrays`` splits their bytes: the last
    ``eval_fraction`` of the joined bytes is held out, and the file that the cut falls in
    becomes two documents. Empty documents are left out. ``files``: as ``read_files``."""
    documents = read_files(patterns, files)
    total = sum(len(doc) for doc in documents)
    if total == 0:
        raise DataError(f"the text corpus {list(patterns)} is empty (0 bytes); point data.paths "
                        "at files with text in them")
    cut = total - int(total * eval_fraction)
    train: list[bytes] = []
    held: list[bytes] = []
    start = 0
    for doc in documents:
        end = start + len(doc)
        if end <= cut:
            train.append(doc)
        elif start >= cut:
            held.append(doc)
        else:
            train.append(doc[:cut - start])
            held.append(doc[cut - start:])
        start = end
    return [d for d in train if d], [d for d in held if d]


def text_splits(cfg) -> dict:
    """A ``text`` section's data: ``{"train": arrays, "eval": arrays, "files": fingerprints}``
    of one source (``data.paths``), or for ``data.mix`` ``{"train": [arrays per source],
    "weights": [...], "eval": every source's held-out rows, "files": ...}``. Bytes in windows,
    or with ``data.tokenizer`` documents packed into rows (``packed_sources``). ``files``: each
    file read with the sha256 of its bytes (``read_files``); none for the standard library's,
    which are no user's files."""
    sources = [source.source for source in cfg.mix] or [cfg.paths or stdlib_patterns()]
    files: dict[str, str] = {}
    recorded = files if cfg.mix or cfg.paths else None
    if cfg.tokenizer is None:
        parts = [text_arrays(cfg, patterns, recorded) for patterns in sources]
    else:
        parts = packed_sources(cfg, sources, recorded)
    if not cfg.mix:
        return {**parts[0], "files": files}
    held = {name: np.concatenate([part["eval"][name] for part in parts])
            for name in parts[0]["eval"]}
    return {"train": [part["train"] for part in parts],
            "weights": [source.weight for source in cfg.mix], "eval": held, "files": files}


def packed_sources(cfg, sources: Sequence[Sequence[str]],
                   files: dict[str, str] | None = None) -> list[dict[str, dict]]:
    """Per source, its training and held-out documents as ``data.tokenizer`` token ids, packed
    into rows of ``seq_len + 1`` (``documents.pack_documents``), with ``token_bytes``: the bytes
    of text each token stands for (0 for padding and document tokens), from which eval reports
    bits per byte. It is left out when the tokenizer does not give back each document's bytes
    (a tokenizer that normalizes text), as the bytes a token covers are then unknown.

    The tokenizer is trained at first use on every source's training documents; the encoded
    ids are kept for the next run (``tokenizer.encoded_cache``). ``files``: as
    ``read_files``."""
    from trainrun.data import tokenizer as tokenizers
    from trainrun.data.documents import pack_documents

    texts = []
    for patterns in sources:
        train, held = split_documents(patterns, cfg.eval_fraction, files)
        texts.append({"train": [doc.decode("utf-8", "replace") for doc in train],
                      "eval": [doc.decode("utf-8", "replace") for doc in held]})
    tokenizer = tokenizers.load_or_train(
        cfg.tokenizer, lambda: [text for split in texts for text in split["train"]],
        cfg.vocab_size)
    table = tokenizers.token_bytes(tokenizer)
    cache = tokenizers.encoded_cache(cfg.tokenizer)
    parts, lossless = [], True
    for split in texts:
        part = {}
        for name, documents in split.items():
            ids = tokenizers.encode(tokenizer, documents, cache)
            lossless = lossless and all(int(table[doc[1:]].sum()) == len(text.encode())
                                        for doc, text in zip(ids, documents, strict=True))
            rows = pack_documents(ids, cfg.seq_len + 1)
            rows["token_bytes"] = np.where(rows["segment_ids"] > 0, table[rows["tokens"]],
                                           0).astype(np.uint16)
            part[name] = rows
        parts.append(part)
    if not lossless:
        for part in parts:
            for rows in part.values():
                rows.pop("token_bytes")
    return parts
