"""A run's own JSON, YAML and text files: written whole, read back as mappings, and a file that no
longer reads named in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from trainrun.errors import UserError
from trainrun.storage import location


def write_text(path: Path, text: str) -> None:
    """Written whole (``location.write_bytes``): locally to a new temporary name and renamed
    (``atomic.replace_file``), so a reader never sees half a file, a write that fails (a full
    disk) leaves the old file and no temporary one, and neither the file nor a name placed in
    advance is written through as a link; on object storage, one PUT."""
    location.write_text(path, text)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=2) + "\n")


class DamagedFile(UserError):
    """A file trainrun wrote in a run directory that no longer reads; one line, exit 2."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} is damaged ({why}); trainrun wrote it and it no longer "
                         "reads: restore it from a copy, or move the run aside")
        self.path = path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object trainrun wrote; ``DamagedFile`` when the file is not one any more."""
    return _object(path, json.loads, "JSON")


def read_yaml(path: Path) -> dict[str, Any]:
    """A run's ``config.yaml`` as a mapping; ``DamagedFile`` when it is not one any more."""
    return _object(path, yaml.safe_load, "YAML")


def _object(path: Path, parse: Any, kind: str) -> dict[str, Any]:
    raw = location.read_bytes(path)
    try:
        value = parse(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        why = f"not UTF-8 text: byte {raw[err.start]:#04x} at offset {err.start}"
    except (ValueError, yaml.YAMLError):
        why = f"not {kind}"
    else:
        if isinstance(value, dict):
            return value
        why = f"not a {kind} mapping"
    raise DamagedFile(path, why)
