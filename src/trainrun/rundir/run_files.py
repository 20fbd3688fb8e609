"""A run's own JSON, YAML and text files: written whole, read back as mappings, and a file that no
longer reads named in one line."""

from __future__ import annotations

import json
from typing import Any

import yaml

from trainrun.errors import UserError
from trainrun.storage import location
from trainrun.storage.location import Location


def write_text(path: Location, text: str) -> None:
    """Written whole (``Location.write_text``): locally to a new temporary name and renamed
    (``atomic.replace_file``), so a reader never sees half a file, a write that fails (a full
    disk) leaves the old file and no temporary one, and neither the file nor a name placed in
    advance is written through as a link; on object storage, one PUT."""
    location.location(path).write_text(text)  # a plain path too: never written in place


def write_json(path: Location, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=2) + "\n")


class DamagedFile(UserError):
    """A file trainrun wrote in a run directory that no longer reads; one line, exit 2."""

    def __init__(self, path: Location, why: str):
        super().__init__(f"{path} is damaged ({why}); trainrun wrote it and it no longer "
                         "reads: restore it from a copy, or move the run aside")
        self.path = path


def read_json(path: Location) -> dict[str, Any]:
    """A JSON object trainrun wrote; ``DamagedFile`` when the file is not one any more."""
    return _object(path, json.loads, "JSON")


def read_yaml(path: Location) -> dict[str, Any]:
    """A run's ``config.yaml`` as a mapping; ``DamagedFile`` when it is not one any more."""
    return _object(path, yaml.safe_load, "YAML")


def _object(path: Location, parse: Any, kind: str) -> dict[str, Any]:
    raw = path.read_bytes()
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
