"""What may change when a run resumes, and what a change means for its bits.

A checkpoint's metadata holds the config and provenance it was written with. On resume:

    config keys that alter the trajectory (model, optimizer, data, seed, ...)  refused unless
                                                                               asked for
    steps                                    allowed; a schedule spanning the run's length is
                                             named, since it then changes the learning rate
    jax / jaxlib / the lock's digest /       allowed; bitwise equality is not promised
    backend / device count
    the bytes of a data file the run reads   refused unless asked for (the run directory's
                                             ``data_files.json`` against the files now)

Bitwise resume also needs the program to compute the same bits in a new process. XLA:CPU does by
default (measured: benchmarks/determinism.py); XLA:GPU does only with deterministic ops (no
atomic scatter-adds or reductions, deterministic autotuning), which ``import trainrun`` turns on
where a GPU plugin is installed (``process.GPU_DETERMINISM_FLAGS``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    renamed,
    schedule_steps,
    warmup_in_steps,
    warmup_steps,
)
from trainrun.errors import UserError
from trainrun.program.optim import build_schedule

# Config keys that do not alter a run's trajectory: ``steps`` extends it, K steps per call does
# not change a bit (tests/training/test_parity.py), eval reads the params without changing them,
# the rest are bookkeeping (rl.log_completions: what is written of the rollouts). Any other
# change is refused unless the user asks for it.
RESUMABLE_KEYS = ("name", "steps", "steps_per_call", "checkpoint", "eval",
                  "data.prefetch_threads", "distributed", "metrics", "profile", "storage",
                  "rl.log_completions")
# Provenance fields that, when they differ, void the promise of bitwise equality ("lock": the
# digest of requirements.lock, the whole tested set of packages).
NUMERIC_PROVENANCE = ("trainrun", "jax", "jaxlib", "lock", "backend", "device_kind",
                      "device_count", "process_count")


SHOWN_CHANGES = 6  # changed keys a refusal names; a whole other config would fill a screen


class ConfigChangedError(UserError):
    """Resuming with config keys that change the trajectory, without asking for it."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every config key that differs and changes the trajectory."""
    old, new = _flat(saved), _flat(current)
    changed = []
    for key in sorted(old.keys() | new.keys()):
        if any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS):
            continue
        if old.get(key, "(absent)") != new.get(key, "(absent)"):
            changed.append(f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    return changed


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config with the keys added since it was written, at their defaults; as it was
    where it no longer loads (every difference is then said)."""
    try:
        return config_from_dict(saved, source=None).to_dict()
    except ConfigError:
        return saved


def same_warmup(saved: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """``saved`` with its warm-up spelled as ``config`` spells it where the two come to the
    same steps (a whole number of steps and a fraction of the run, e.g. 50 and 0.0833 of
    600): the trajectory is the same, so resuming is no change."""
    try:
        schedule = saved["optimizer"]["schedule"]
        old = schedule["warmup"]
        new = getattr(config.optimizer.schedule, "warmup", None)
        if new is None or old == new:
            return saved
        old_steps = warmup_in_steps(old, schedule.get("total_steps") or saved["steps"])
        total = schedule_steps(config.optimizer.schedule, config.steps)
    except (KeyError, TypeError, ValueError):  # not a warmed schedule: compared as it is
        return saved
    if old_steps != warmup_steps(config.optimizer.schedule, total):
        return saved
    optimizer = {**saved["optimizer"], "schedule": {**schedule, "warmup": new}}
    return {**saved, "optimizer": optimizer}


def check_config(saved: dict[str, Any], config: RunConfig, allow: bool, where: Path) -> list[str]:
    """The trajectory-changing differences between a checkpoint's config and ``config``;
    raises unless ``allow``."""
    # a checkpoint written before a key was renamed holds it by its old name, and one written
    # before a key was added holds none: its default, which computes what was computed before
    changes = config_changes(same_warmup(_with_defaults(renamed.upgrade(saved, None)), config),
                             config.to_dict())
    if changes and not allow:
        raise ConfigChangedError(
            f"{where} was trained with a different config ({_first(changes)}); resuming with these "
            "changes alters the run. Leave out --config to resume with the run's own config "
            "(overrides apply over it), pass --allow-config-change to resume anyway, or "
            "--fresh to move the run aside")
    return changes


class DataChangedError(UserError):
    """Resuming on data files whose content differs from what the run trained on, without
    asking for it."""


def data_changes(saved: dict[str, str], current: dict[str, str]) -> list[str]:
    """How the data files read now differ from those a run recorded (name -> content
    fingerprint): each file whose content changed, that is new, or that is no longer read."""
    changed = []
    for name in sorted(saved.keys() | current.keys()):
        if name not in current:
            changed.append(f"{name} is no longer read")
        elif name not in saved:
            changed.append(f"{name} is read now and was not")
        elif saved[name] != current[name]:
            changed.append(f"{name} changed")
    return changed


def check_data(saved: dict[str, str] | None, current: dict[str, str], allow: bool,
               where: Path, tokenizer_changed: bool = False) -> list[str]:
    """The differences between the data files a run recorded (None: it recorded none, so
    there is nothing to compare) and those read now, and whether the tokenizer the data is
    read with is not the one the run keeps; raises unless ``allow``."""
    changes = [] if saved is None else data_changes(saved, current)
    if tokenizer_changed:
        changes.insert(0, "data.tokenizer is not the one it trained with, kept in tokenizer/")
    if changes and not allow:
        raise DataChangedError(
            f"{where} was trained on other data ({_first(changes)}); resuming on it alters the "
            "run. Put the data back as it was, pass --allow-data-change to resume anyway, or "
            "--fresh to move the run aside")
    return changes


def _first(changes: list[str]) -> str:
    """The first ``SHOWN_CHANGES`` changes, and how many more there are."""
    more = len(changes) - SHOWN_CHANGES
    return "; ".join(changes[:SHOWN_CHANGES]) + (f"; and {more} more" if more > 0 else "")


def schedule_shift(saved: dict[str, Any], config: RunConfig, step: int) -> int | None:
    """With ``steps`` changed on resume, the first step from ``step`` on whose learning rate
    differs from the schedule the checkpoint was trained on (a schedule that spans the run's
    length, e.g. cosine with no total_steps); None if it is the same."""
    old_steps = saved.get("steps", config.steps)
    if old_steps == config.steps or step >= config.steps:
        return None
    counts = jnp.arange(step, config.steps)
    old, new = (jax.vmap(build_schedule(config.optimizer, n))(counts)
                for n in (old_steps, config.steps))
    differ = np.flatnonzero(np.asarray(old) != np.asarray(new))
    return step + int(differ[0]) if differ.size else None


def provenance_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [f"{key} {saved.get(key)} -> {current.get(key)}" for key in NUMERIC_PROVENANCE
            if saved.get(key) != current.get(key)]
