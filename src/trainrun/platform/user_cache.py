"""Where trainrun keeps what it can make again: measured figures, tokenized records."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TRAINRUN_CACHE_DIR``, else ``trainrun`` in the user's cache dir (``$XDG_CACHE_HOME``
    or ``~/.cache``)."""
    if os.environ.get("TRAINRUN_CACHE_DIR"):
        return Path(os.environ["TRAINRUN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainrun"


class CompilationCacheWarning(UserWarning):
    """The compiled-program cache is off for this process: its folder cannot be written."""
