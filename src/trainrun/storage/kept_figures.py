"""Figures derived from a compiled program that a later process reads back instead of deriving
again: kept beside the compiled programs (``process.keep_compiled_programs``), one small JSON
file per key, only while this process keeps its programs there.

A figure is kept under a digest of everything it depends on (the program's text, the versions
and the backend), so a hit is the figure the same derivation would give, bit for bit."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import jax

from trainrun.platform.process import kept_programs_folder
from trainrun.storage.atomic import replace_file

FIGURES = "figures"  # the subfolder of the compiled-programs folder; JAX's eviction skips it


def figure_key(kind: str, *parts: bytes | str) -> str:
    """A digest of ``kind``, ``parts``, the JAX and jaxlib versions and the default backend
    (its platform and version): the name a figure is kept under."""
    import jaxlib.version

    backend = jax.devices()[0].client
    digest = hashlib.sha256()
    for part in (kind, jax.__version__, jaxlib.version.__version__, backend.platform,
                 backend.platform_version, *parts):
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return f"{kind}-{digest.hexdigest()}"


def _folder() -> Path | None:
    programs = kept_programs_folder()
    if programs is None:
        return None
    folder = programs / FIGURES
    return None if folder.is_symlink() else folder


def recall(key: str) -> tuple[float | None] | None:
    """``(figure,)`` kept under ``key`` (the figure may be None: there was none to derive), or
    None where nothing readable is kept or no programs are kept in this process."""
    folder = _folder()
    if folder is None:
        return None
    path = folder / f"{key}.json"
    try:
        if path.is_symlink():
            return None
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # missing, unreadable or garbled: derived again and written anew
    figure = kept.get("figure", "absent") if isinstance(kept, dict) else "absent"
    if figure is None:
        return (None,)
    if isinstance(figure, int | float) and not isinstance(figure, bool) and math.isfinite(figure):
        return (float(figure),)
    return None


def keep(key: str, figure: float | None) -> None:
    """Keep ``figure`` under ``key`` for later processes (a no-op where this process keeps no
    programs). Written whole or not at all; a folder that cannot be written costs nothing but
    the next process's derivation."""
    folder = _folder()
    if folder is None:
        return
    try:
        folder.mkdir(exist_ok=True)
        replace_file(folder / f"{key}.json", json.dumps({"figure": figure}))
    except OSError:
        return
