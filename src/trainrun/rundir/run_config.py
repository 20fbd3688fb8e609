"""Which config a ``train`` (or ``config show``) command means: the one ``--config`` names, or,
without ``--config``, the run directory's own saved ``config.yaml``, so that
``trainrun train --run-dir DIR steps=N`` resumes or extends DIR as it was trained, whatever
config made it. The command line's overrides apply over either."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainrun.config import Layer, RunConfig, config_from_layers, config_layers, saved_layers
from trainrun.rundir.layout import CONFIG, MARKER, default_run_dir
from trainrun.rundir.ownership import inspect
from trainrun.storage import location
from trainrun.storage.location import Location

DEFAULT_CONFIG = "mlp"  # the built-in config of a command that names none and no run


@dataclasses.dataclass(frozen=True)
class CommandConfig:
    """The config a command resolved to, the layers it came from, and its run directory;
    ``saved``: the run's ``config.yaml`` that is the base, when it is."""

    config: RunConfig
    layers: list[Layer]
    run_dir: Location
    saved: Location | None


def saved_config_file(run_dir: Location) -> Location | None:
    """The ``config.yaml`` of a trainrun run directory (marked, or from before the marker);
    None for any other folder, or a run that had not written it yet. On object storage, a
    location with trainrun's marker."""
    local = run_dir.local_path
    if local is None:  # no folder to inspect: a location with trainrun's marker
        path = run_dir / CONFIG
        return path if ((run_dir / MARKER).is_file() and path.is_file()) else None
    if inspect(local).kind not in ("marked", "legacy"):
        return None
    path = run_dir / CONFIG
    return path if path.is_file() else None


def command_config(config_name: str | None, overrides: list[str],
                   run_dir: str | Path | None) -> CommandConfig:
    """The config of ``trainrun train [--config NAME] [--run-dir DIR] key=value ...``.

    Without ``config_name``, a run directory (``run_dir``, else the default one the built-in
    config's name gives) that holds a trainrun run's saved config makes that config the base;
    otherwise the built-in ``mlp`` is."""
    if config_name is None:
        path = _location(run_dir) if run_dir is not None else None
        if path is None:  # the default run directory follows the config's (or overrides') name
            path = default_run_dir(config_from_layers(config_layers(DEFAULT_CONFIG, overrides)))
        saved = saved_config_file(path)
        if saved is not None:
            layers = saved_layers(saved, overrides)
            return CommandConfig(config_from_layers(layers), layers, path, saved)
        config_name = DEFAULT_CONFIG
    layers = config_layers(config_name, overrides)
    config = config_from_layers(layers)
    path = _location(run_dir) if run_dir is not None else default_run_dir(config)
    return CommandConfig(config, layers, path, None)


def _location(run_dir: str | Path) -> Location:
    """Where the run directory enters: a local path, or a ``gs://``/``s3://`` location (never
    a folder ``gs:``)."""
    return location.location(run_dir)
