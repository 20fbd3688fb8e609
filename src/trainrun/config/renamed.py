"""Config keys that have a new name. A tree that gives a key by its old name is read as if it
gave the new one, with a one-line warning naming the new key (once per key, source and
process), until the release after the next refuses the old name as it would any unknown key."""

from __future__ import annotations

import warnings
from typing import Any

# old dotted key -> its new dotted key
RENAMED: dict[str, str] = {
    "log_every": "metrics.every",
    "optimizer.schedule.warmup_steps": "optimizer.schedule.warmup",
    "data.train": "data.paths",  # arrays, tokens: the same key as text and records
    "data.eval": "data.eval_paths",  # arrays, tokens: not the top-level eval (its cadence)
    "data.task": "data.synthetic",  # records: not the model's task (its loss)
    "data.task_examples": "data.synthetic_examples",
}

_warned: set[str] = set()  # the warnings issued in this process: each is issued once


class RenamedKeyWarning(FutureWarning):
    """A config key given by its old name; the message names the new one."""


def upgrade(tree: dict[str, Any], source: str | None, root: str = "") -> dict[str, Any]:
    """``tree`` (the section at dotted ``root``) with every old key moved to its new name.

    source: where the tree came from, named in the warning (``my.yaml``, ``the overrides``);
        None: no warning (a config trainrun wrote, such as a run's saved ``config.yaml``).

    Raises:
        ValueError: the tree gives a key under both its names.
    """
    prefix = f"{root}." if root else ""
    for old, new in RENAMED.items():
        if not (old.startswith(prefix) and new.startswith(prefix)):
            continue
        old_path, new_path = old[len(prefix):].split("."), new[len(prefix):].split(".")
        found, value = _get(tree, old_path)
        if not found:
            continue
        if _get(tree, new_path)[0]:
            where = f" in {source}" if source else ""
            raise ValueError(f"{old} and {new} are both given{where}; keep {new} alone "
                             f"({old} is its old name)")
        tree = _set(_remove(tree, old_path), new_path, value)
        if source is not None:
            _warn(f"config key {old} is now {new}; rename it in {source} (the old name will "
                  "be refused after the next release)")
    return tree


def _warn(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(RenamedKeyWarning(message), stacklevel=4)


def _get(tree: Any, path: list[str]) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False, None
        tree = tree[key]
    return True, tree


def _remove(tree: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """A copy of ``tree`` without the key at ``path`` (which holds one)."""
    out = dict(tree)
    if len(path) == 1:
        del out[path[0]]
    else:
        out[path[0]] = _remove(out[path[0]], path[1:])
    return out


def _set(tree: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with ``value`` at ``path``; a section not given is made, and a value
    where a section would go is left for validation to refuse."""
    out = dict(tree)
    if len(path) == 1:
        out[path[0]] = value
    elif out.get(path[0]) is None:
        out[path[0]] = _set({}, path[1:], value)
    elif isinstance(out[path[0]], dict):
        out[path[0]] = _set(out[path[0]], path[1:], value)
    return out
