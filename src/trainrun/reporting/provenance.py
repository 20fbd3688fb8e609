"""What a measured figure was measured on: package versions, the lock file's digest, the
backend and its devices, the process count, XLA_FLAGS and the config's digest."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import jax


def package_version(name: str) -> str:
    """An installed package's version, or "unknown" where it has no metadata (trainrun run from
    a source checkout on ``PYTHONPATH``)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


# The exact set of packages trainrun is tested with; a source checkout holds it beside src/.
LOCK_FILE = Path(__file__).resolve().parents[3] / "requirements.lock"


@functools.cache
def lock_digest(path: Path = LOCK_FILE) -> str:
    """sha256 of ``requirements.lock`` beside the source checkout trainrun runs from (the one
    holding ``src/trainrun``); "unknown" for an installed wheel, which carries no lock."""
    try:
        if (path.parent / "src" / "trainrun").is_dir():
            return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:  # unreadable or missing: the provenance says so rather than fail the run
        pass
    return "unknown"


def provenance(config_digest: str, fast_paths: list[str] | None = None) -> dict[str, Any]:
    """What a figure was measured on; written to ``provenance.json`` and the summary.
    fast_paths: the fast paths that were on (``platform/fast_paths.py``)."""
    devices = jax.devices()
    return {
        "trainrun": package_version("trainrun"),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib"),
        "lock": lock_digest(),  # requirements.lock's sha256: the tested set of packages
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_count": jax.process_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "config_digest": config_digest,
        "fast_paths": fast_paths if fast_paths is not None else [],
    }
