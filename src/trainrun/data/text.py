"""Text files as a byte-level language-model corpus.

The files a set of glob patterns match are read in sorted order and joined into one byte stream;
the last ``eval_fraction`` of it is held out. Each example is a window of ``seq_len + 1`` bytes
(inputs plus the next byte to predict) starting at a multiple of ``seq_len``.

The default corpus is the ``.py`` files of the running Python's standard library (installed
packages excluded): real code present on every machine. It differs between Python versions
(each release adds, removes and edits modules), so byte counts and losses differ slightly too.
"""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainrun.data.pipeline import DataError, token_windows

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_patterns() -> tuple[str, ...]:
    return (str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"),)


def corpus_files(patterns: Sequence[str]) -> list[Path]:
    """The files the patterns match (``**`` recurses), sorted and without duplicates."""
    found: set[Path] = set()
    for pattern in patterns:
        matches = [Path(p) for p in glob.glob(str(Path(pattern).expanduser()), recursive=True)]
        files = [p for p in matches if p.is_file() and not EXCLUDED_DIRS & set(p.parts)]
        if not files:
            raise DataError(f"data.paths pattern {pattern!r} matches no files; check the path "
                            "(use ** to search subdirectories)")
        found.update(files)
    return sorted(found)


def read_corpus(patterns: Sequence[str]) -> np.ndarray:
    """The matched files' bytes, joined, as a uint8 array."""
    blob = b"".join(path.read_bytes() for path in corpus_files(patterns))
    return np.frombuffer(blob, np.uint8)


def text_arrays(cfg) -> dict[str, dict[str, np.ndarray]]:
    """``{"train": {"tokens"}, "eval": {"tokens"}}``: windows ``[N, seq_len + 1]`` uint8."""
    patterns = cfg.paths or stdlib_patterns()
    stream = read_corpus(patterns)
    if stream.size == 0:
        raise DataError(f"the text corpus {list(patterns)} is empty (0 bytes); point data.paths "
                        "at files with text in them")
    held_out = int(stream.size * cfg.eval_fraction)
    train, held = stream[:stream.size - held_out], stream[stream.size - held_out:]
    return {"train": {"tokens": token_windows(train, cfg.seq_len, "the training text")},
            "eval": {"tokens": token_windows(held, cfg.seq_len, "the held-out text",
                                             strict=False)}}
