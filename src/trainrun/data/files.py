"""User data from files: NumPy arrays (``.npy``, ``.npz``) and nanoGPT-style token files.

A token file is a flat binary array of token ids (uint16 for vocabularies up to 65,536, as
nanoGPT's ``prepare.py`` writes ``train.bin``/``val.bin``). It is memory-mapped, so a process
reads from disk only the windows of its own batches.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.data.errors import DataError
from trainrun.data.pipeline import token_windows
from trainrun.storage import location

Arrays = dict[str, np.ndarray]


def _existing(path: str, key: str) -> Path:
    """The local file ``path``; a location of object storage, or a URL trainrun does not take
    (refused as the location is made), is one line."""
    file = location.location(path).local_path
    if file is None:
        raise DataError(f"{key}: {path!r} is on object storage, and arrays and token files are "
                        "memory-mapped from a local disk; copy it there and give its path")
    if not file.is_file():
        raise DataError(f"{key}: file {path!r} not found; give the path of an existing file")
    return file


def load_arrays(spec: str | dict[str, str], key: str) -> Arrays:
    """A ``.npz`` path (all its arrays) or ``{name: path.npy}``; ``.npy`` files are mapped."""
    if isinstance(spec, str):
        file = _existing(spec, key)
        if file.suffix != ".npz":
            raise DataError(f"{key}: {spec!r} is not a .npz file; give a .npz, or a mapping "
                            "of names to .npy files (e.g. {x: x.npy, label: y.npy})")
        try:
            with np.load(file) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:  # EOF: 0 bytes
            raise DataError(f"{key}: cannot read {spec!r} as .npz ({err})") from None
    else:
        arrays = {}
        for name, path in spec.items():
            file = _existing(path, f"{key}.{name}")
            try:
                arrays[name] = np.load(file, mmap_mode="r")
            except (OSError, ValueError, EOFError) as err:
                raise DataError(f"{key}.{name}: cannot read {path!r} as .npy ({err})") from None
    if not arrays:
        raise DataError(f"{key}: {spec!r} holds no arrays")
    scalars = [name for name, a in arrays.items() if a.ndim == 0]
    if scalars:
        raise DataError(f"{key}: arrays {scalars} are scalars; every array needs one entry per "
                        "example on its first axis")
    return arrays


def fingerprints(*specs: str | dict[str, str] | None) -> dict[str, str]:
    """Each file the specs name (a path, or names to paths; None: none) with the sha256 of its
    bytes (``sha256:<hex>``), read a block at a time: mapped files are not read whole
    otherwise, so this is their one read through."""
    paths = [path for spec in specs if spec is not None
             for path in ([spec] if isinstance(spec, str) else spec.values())]
    found = {}
    for path in paths:
        with open(Path(path).expanduser(), "rb") as file:
            found[path] = f"sha256:{hashlib.file_digest(file, 'sha256').hexdigest()}"
    return found


def array_splits(cfg) -> dict[str, Any]:
    """``{"train": arrays, "eval": arrays or None, "files": fingerprints}`` of ``data.paths``
    and ``data.eval_paths``."""
    if cfg.paths is None:
        raise DataError("data.kind=arrays needs data.paths: a .npz file or a mapping of names "
                        "to .npy files")
    return {"train": load_arrays(cfg.paths, "data.paths"),
            "eval": (load_arrays(cfg.eval_paths, "data.eval_paths")
                     if cfg.eval_paths is not None else None),
            "files": fingerprints(cfg.paths, cfg.eval_paths)}


def load_tokens(path: str, dtype: str, key: str) -> np.ndarray:
    """A memory map of the token ids in ``path``."""
    file = _existing(path, key)
    size, itemsize = file.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"{key}: token file {path!r} is empty; write token ids into it")
    if size % itemsize:
        raise DataError(f"{key}: {path!r} has {size} bytes, not a whole number of {dtype} "
                        f"tokens; check data.dtype")
    return np.memmap(file, dtype=dtype, mode="r")


def token_splits(cfg) -> dict[str, Any]:
    """``{"train": windows, "eval": windows or None, "files": fingerprints}`` of the token
    files ``data.paths`` and ``data.eval_paths``."""
    if cfg.paths is None:
        raise DataError("data.kind=tokens needs data.paths: the path of a .bin token file")
    train = load_tokens(cfg.paths, cfg.dtype, "data.paths")
    held = (load_tokens(cfg.eval_paths, cfg.dtype, "data.eval_paths")
            if cfg.eval_paths is not None else None)
    return {"train": {"tokens": token_windows(train, cfg.seq_len, f"data.paths {cfg.paths!r}")},
            "eval": None if held is None else
            {"tokens": token_windows(held, cfg.seq_len, f"data.eval_paths {cfg.eval_paths!r}",
                                     strict=False)},
            "files": fingerprints(cfg.paths, cfg.eval_paths)}
