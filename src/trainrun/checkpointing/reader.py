"""The one read-only reader of a run directory: its saved config and its newest readable
checkpoint, for sampling, export and ``init.from``. It opens nothing for writing, so it is
safe while the run is still training and saving. A run on object storage (``gs://``, ``s3://``)
is read through the storage layer and Orbax alike; there only the steps whose commit file
Orbax wrote (``rundir.committed_steps``) are read."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from trainrun import rundir
from trainrun.checkpointing import object_store
from trainrun.checkpointing.checkpoints import (
    Unreadable,
    checkpoint_dir,
    newest_readable,
    readable,
)
from trainrun.checkpointing.integrity import step_record_problem, verify_step
from trainrun.config import ConfigError, RunConfig, config_from_dict
from trainrun.errors import UserError
from trainrun.models import Model
from trainrun.program.state import run_abstract_state, state_from_tree, state_tree
from trainrun.storage import location

PyTree = Any


class RunReadError(UserError):
    """A run directory that cannot be read as asked; one line, exit 2."""


def saved_config(run_dir: location.Location | str | os.PathLike[str]) -> RunConfig:
    """The resolved config a run directory was trained with (its ``config.yaml``); read by
    sampling, export and ``init.from``."""
    run_dir = location.location(run_dir)  # a path given here enters here
    path = run_dir / rundir.CONFIG
    if not path.is_file():
        run_dir.require_bucket()
        raise RunReadError(f"{run_dir} is not a run directory (no {rundir.CONFIG}); give the "
                          "directory a training run wrote, e.g. runs/lm")
    try:
        return config_from_dict(rundir.read_yaml(path), source=None)  # written by trainrun
    except ConfigError as err:
        raise RunReadError(f"the config saved in {path} no longer loads: {err}") from None


def latest_params(run_dir: location.Location | str | os.PathLike[str], config: RunConfig,
                  step: int | None = None) -> tuple[int, PyTree]:
    """``(step, params)`` of the run's newest readable checkpoint, or of ``step`` (see
    ``latest_state``)."""
    run_dir = location.location(run_dir)  # a path given here enters here
    found, state = latest_state(run_dir, config, optimizer_state=False, step=step)
    return found, state.params


def latest_state(run_dir: location.Location | str | os.PathLike[str], config: RunConfig,
                 model: Model | None = None, *,
                 optimizer_state: bool = True, step: int | None = None) -> tuple[int, Any]:
    """``(step, TrainState)`` of the run's newest readable checkpoint, on one device. model:
    the run's model where the caller built it already; else the one its kind trains
    (``models/kind_models.py``). optimizer_state: False leaves the optimizer's state unread
    (its leaves are ``ocp.PLACEHOLDER``): for what scores, samples or exports the params, to
    which an Adam state adds twice their size in reading and memory. step: that committed
    step's state instead (refused in one line naming the steps there are; read as it is or
    not at all).

    Read-only: the checkpoint directory is opened without creating, cleaning or deleting
    anything, so sampling is safe while the run is still training and saving. A newest step
    that cannot be read, or whose files do not match their checksums, is skipped for the one
    before it, as a resume would.
    """
    run_dir = location.location(run_dir)  # a path given here enters here
    directory = checkpoint_dir(config, run_dir).absolute()
    remote = not directory.renames  # Orbax's commit file marks a step committed
    if not directory.is_dir():
        raise RunReadError(f"{run_dir} has no checkpoints ({directory} does not exist); train "
                          "it first, e.g. trainrun train --config lm")
    if remote:  # Orbax and TensorStore told how to reach the store and what commits a step
        object_store.prepare(directory)
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, enable_async_checkpointing=False,
        **(object_store.manager_options() if remote else {}))
    with _without_read_only_notice(), _opened(directory, options) as ckpt:
        steps = sorted(rundir.committed_steps(directory) if remote else ckpt.all_steps(),
                       reverse=True)
        if not steps:
            raise RunReadError(f"{directory} holds no committed checkpoint yet; let the run "
                              "reach its first checkpoint (checkpoint.every) and try again")
        if step is not None and step not in steps:
            raise RunReadError(f"{run_dir} has no checkpoint of step {step}; its steps: "
                              f"{', '.join(map(str, sorted(steps)))}")
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        # plain dicts: Orbax fills them without calling back into the state's classes
        abstract = state_tree(run_abstract_state(config, model))
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                              abstract)
        if not optimizer_state:
            target["opt_state"] = jax.tree.map(lambda _: ocp.PLACEHOLDER, target["opt_state"])
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)

        def read(step: int) -> Any:  # a step whose files changed or fail: the one before
            changed = verify_step(directory / str(step), read=False).problems  # its checksums
            if changed:
                raise Unreadable(changed[0])
            return state_from_tree(readable(lambda: ckpt.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))))["state"])

        found, state, problems = newest_readable([step] if step is not None else steps, read)
        if found is not None and state is not None:  # state: a step was read
            return found, state
    raise RunReadError(f"no checkpoint in {directory} can be read ("
                      + "; ".join(f"step {s}: {why}" for s, why in problems)
                      + "): restore its files from a copy, or train the run again")


@contextlib.contextmanager
def _opened(directory: location.Location, options: ocp.CheckpointManagerOptions
            ) -> Iterator[ocp.CheckpointManager]:
    """Orbax's manager of the checkpoints in ``directory``. Orbax reads every step's record as
    it opens them, and stops on one it cannot take: that is one line naming each such record
    (a resume rewrites them: ``checkpoints.repair_step_metadata``). The state is read with the
    PyTree handler, the one under the standard handler that saved it, which can leave parts of
    the tree unread (``ocp.PLACEHOLDER``)."""
    try:
        manager = ocp.CheckpointManager(directory.epath(), options=options,
                                        item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    except ValueError:
        steps = sorted(int(name) for name in directory.list_names() if name.isdigit())
        found = [f"{directory / str(step)}: {why}" for step in steps
                 if (why := step_record_problem(directory / str(step))) is not None]
        if not found:
            raise
        raise RunReadError("; ".join(found) + "; resuming the run (trainrun train) rewrites "
                           "it, or restore the file from a copy") from None
    with manager:
        yield manager


@contextlib.contextmanager
def _without_read_only_notice() -> Iterator[None]:
    """Orbax logs a warning for every read-only manager it opens, which is what reading a run's
    checkpoint is, and an error for a step whose own record (``_CHECKPOINT_METADATA``) is
    garbled, which a read does not need (the step's files are checked by their checksums):
    those records are dropped while it is open, the process's logging left as is."""

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "is read only" not in message and "Failed to read Metadata file" not in message

    absl = logging.getLogger("absl")
    absl.addFilter(keep)
    try:
        yield
    finally:
        absl.removeFilter(keep)
