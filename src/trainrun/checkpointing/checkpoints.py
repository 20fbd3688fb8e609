"""Whole-state checkpoints through Orbax: one atomic step directory per checkpoint.

    <checkpoint dir>/<step>/state/   the whole TrainState (params, opt_state, step, typed key, ...)
                            data/    the data iterator's position (Grain get_state, per process)
                            meta/    resolved config, provenance, trainrun version (JSON)

Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it once every item is on
disk, so a kill at any moment leaves either a committed step or a temporary directory that is
never listed as a step and is removed when the directory is next opened.

Every item directory holds the sha256 of each of its files (``integrity.py``), written before
the step is committed and compared before it is read. Restore goes newest first: a step that
cannot be read (a truncated, missing or changed file) is moved aside with a warning and the
previous committed one is used; a step written by a different model
is an error that names the differing leaves and changes nothing on disk.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from trainrun import rundir
from trainrun.checkpointing import integrity, object_store
from trainrun.config import RunConfig
from trainrun.errors import UserError, WriteFailed
from trainrun.rundir import write_failures
from trainrun.storage import location
from trainrun.storage.location import Location

DEFAULT_DIR = rundir.CHECKPOINTS
CORRUPT_DIR = "corrupt"  # unreadable steps are moved here, never deleted
TMP_MARK = rundir.ORBAX_TMP

PyTree = Any


class CheckpointError(UserError):
    """A checkpoint that cannot be used as asked; the CLI prints it on one line and exits 2."""


def checkpoint_dir(config: RunConfig, run_dir: Location) -> Location:
    """``checkpoint.dir``, else the run directory's; a ``gs://``/``s3://`` one stays remote."""
    return (location.location(config.checkpoint.dir) if config.checkpoint.dir
            else run_dir / DEFAULT_DIR)


def has_position(iterator: Any) -> bool:
    """Whether the iterator's position can be saved (Grain's get_state/set_state)."""
    return hasattr(iterator, "get_state") and hasattr(iterator, "set_state")


class DataHandler:
    """The data position, in Grain's layout (``process_<i>-of-<n>.json``), for any iterator with
    ``get_state``/``set_state``: Grain's own iterators and trainrun's ``BatchCursor`` (whose
    state is a dict, which Grain's handler does not take). It has the methods of Grain's
    handler without subclassing it, so reading a checkpoint does not import Grain.

    Restoring onto another process count reads the position any process saved when they all
    agree (trainrun's datasets index global batches, so the position is the same everywhere).
    """

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        state = (item or args.item).get_state()
        text = state.decode() if isinstance(state, bytes) else json.dumps(state, indent=1)
        (directory / _process_file()).write_text(text)

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        item = item or args.item
        own = directory / _process_file()
        saved = ({own.read_text()} if own.exists()
                 else {p.read_text() for p in directory.glob("process_*-of-*.json")})
        if len(saved) != 1:
            raise ValueError(f"{own.name} is missing and the other processes' positions "
                             "differ" if saved else f"{own.name} is missing")
        text = saved.pop()
        import grain  # here: reading a checkpoint's state alone needs no Grain

        item.set_state(text.encode() if isinstance(item, grain.DataLoaderIterator)
                       else json.loads(text))
        return item

    def finalize(self, directory: Any) -> None:
        integrity.write_manifest(directory)

    # Orbax's interface: a position has no tree structure nor metadata.
    def structure(self, directory: Any) -> None:
        return None

    def metadata(self, directory: Any) -> None:
        return None

    def close(self) -> None:
        pass

    @classmethod
    def typestr(cls) -> str:  # the name Grain's handler gives it, kept in step metadata
        return f"{cls.__module__}.{cls.__qualname__}"


class StateHandler(ocp.StandardCheckpointHandler):
    """Orbax's handler for the state, plus the checksums of its files once they are final
    (after Orbax merges the processes' OCDBT databases)."""

    def finalize(self, directory):
        super().finalize(directory)
        integrity.write_manifest(directory)


class MetaHandler(ocp.JsonCheckpointHandler):
    def finalize(self, directory):
        super().finalize(directory)
        integrity.write_manifest(directory)


# Orbax finds an item's handler by the type of its args: these name the handlers above.
@ocp.args.register_with_handler(StateHandler, for_save=True)
class StateSave(ocp.args.StandardSave):
    pass


@ocp.args.register_with_handler(StateHandler, for_restore=True)
class StateRestore(ocp.args.StandardRestore):
    pass


@ocp.args.register_with_handler(MetaHandler, for_save=True)
class MetaSave(ocp.args.JsonSave):
    pass


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
class MetaRestore(ocp.args.JsonRestore):
    pass


def _process_file() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


# Grain's handler implements Orbax's interface by duck typing; Orbax's types want a subclass.
@ocp.args.register_with_handler(
    DataHandler, for_save=True)  # pyright: ignore[reportArgumentType]
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    item: Any


# Grain's handler implements Orbax's interface by duck typing; Orbax's types want a subclass.
@ocp.args.register_with_handler(
    DataHandler, for_restore=True)  # pyright: ignore[reportArgumentType]
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    item: Any


@dataclasses.dataclass
class Restored:
    step: int
    state: PyTree
    metadata: dict[str, Any]
    moved: list[tuple[int, str, Location]]  # unreadable newer steps: (step, why, moved to)
    verified: bool = True  # False: saved without checksums (by an earlier trainrun)


class Unreadable(Exception):
    """A checkpoint step that cannot be read; the message says why."""


def readable(read: Callable[[], Any]) -> Any:
    """``read()``, with any error from the files (truncated, missing) as ``Unreadable``."""
    try:
        return read()
    except Exception as err:
        raise Unreadable(_reason(err)) from err


def newest_readable(steps: Iterable[int], read: Callable[[int], Any]
                    ) -> tuple[int | None, Any, list[tuple[int, str]]]:
    """Newest first, the first step that ``read`` reads: ``(step, what it returned, the newer
    steps it could not read and why)``; ``(None, None, ...)`` when none can be. ``read`` raises
    ``Unreadable`` to fall back to the step before; any other error ends the search (a
    checkpoint of another model is refused, not skipped). Resume and sampling both use it."""
    unreadable: list[tuple[int, str]] = []
    for step in sorted(steps, reverse=True):
        try:
            return step, read(step), unreadable
        except Unreadable as err:
            unreadable.append((step, str(err)))
    return None, None, unreadable


STEP_METADATA = integrity.STEP_RECORD  # Orbax writes it when a step is committed


def finish_deletions(directory: Path) -> list[str]:
    """Removes the step directories that lack Orbax's step metadata while a newer step has it:
    old steps whose deletion (``checkpoint.keep``) a kill cut short. Returns their names."""
    if not directory.is_dir():
        return []
    steps = sorted((int(p.name), p) for p in directory.iterdir()
                   if p.name.isdigit() and p.is_dir() and not p.is_symlink())
    complete = [step for step, p in steps if (p / STEP_METADATA).is_file()]
    if not complete:
        return []
    cut = [p for step, p in steps if step < complete[-1] and not (p / STEP_METADATA).exists()]
    for path in cut:
        shutil.rmtree(path)
    return [p.name for p in cut]


def repair_step_metadata(directory: Path) -> list[str]:
    """Rewrites, as an empty record, each step's Orbax metadata file that Orbax cannot read
    (``integrity.step_record_problem``): it lies outside trainrun's checksums (the step's own
    files are checked when it is read), and Orbax would log its parse error on every start or
    stop on a record it cannot take. Returns the steps' names."""
    if not directory.is_dir():
        return []
    repaired = []
    for path in sorted(directory.iterdir()):
        record = path / STEP_METADATA
        if not (path.name.isdigit() and record.is_file() and not record.is_symlink()):
            continue
        if integrity.step_record_problem(location.local(path)) is not None:
            rundir.write_text(location.local(record), "{}\n")
            repaired.append(path.name)
    return repaired


class Checkpoints:
    """The run's checkpoint directory: save a step (when: ``checkpoint_policy.py``), keep the
    latest ``keep`` (and the best by ``keep_best``), restore the newest readable one.

    On object storage, ``stalled(last_committed)`` gives the error that ends a wait for a save
    the store no longer answers (the run's mirror failed past storage.deadline_s; None: go on
    waiting), and ``say`` where progress of a long wait is said."""

    def __init__(self, directory: Location | str | os.PathLike[str], config: RunConfig,
                 provenance: dict[str, Any], *,
                 stalled: Callable[[int | None], Exception | None] | None = None,
                 say: Callable[[str], None] | None = None):
        directory = location.location(directory)  # a path given here enters here
        self.directory = directory.absolute()
        self.remote = not directory.renames  # Orbax's commit file marks a step committed
        local = self.directory.local_path
        self.config = config
        self.cfg = cfg = config.checkpoint
        self.provenance = provenance
        primary = jax.process_index() == 0
        if local is None:  # a step without Orbax's commit file is partial
            object_store.prepare(self.directory)
            self.partial = rundir.uncommitted_steps(self.directory) if primary else []
            self.half_deleted, self.repaired = [], []
        else:
            self.partial = sorted(p.name for p in local.glob(f"*{TMP_MARK}*"))
            # old steps a killed run was deleting, finished off (Orbax warns on each start)
            self.half_deleted = finish_deletions(local) if primary else []
            self.repaired = repair_step_metadata(local) if primary else []
        policies = ocp.checkpoint_managers
        keep = policies.LatestN(cfg.keep)
        best: dict[str, Any] = {}
        if cfg.keep_best:  # Orbax ranks the saves that carry the metric (best_fn, best_mode)
            best = {"best_fn": lambda metrics: metrics[cfg.keep_best],
                    "best_mode": cfg.keep_best_mode}
            keep = policies.AnyPreservationPolicy([keep, policies.BestN(
                get_metric_fn=best["best_fn"], reverse=cfg.keep_best_mode == "min", n=1,
                keep_checkpoints_without_metrics=False)])
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_,
            preservation_policy=keep,  # the latest `keep` always: a resume never goes back
            cleanup_tmp_directories=True,  # partial saves of a killed run
            **best,
            **(object_store.manager_options() if self.remote else {}),
        )
        # A refused write (a full disk) is reported by the run on one line, not by Orbax's
        # threads with a traceback each.
        self._unquiet = write_failures.quiet_orbax_errors()
        handlers = {"state": StateHandler(), "data": DataHandler(), "meta": MetaHandler()}
        self.manager = ocp.CheckpointManager(
            self.directory.epath(), options=options,
            # DataHandler is an Orbax handler by duck typing (Grain's), not by subclass.
            item_handlers=handlers)  # pyright: ignore[reportArgumentType]
        self._in_flight = False  # a save may still be being written in the background
        self._closed = False
        self.stalled, self.say = stalled, say
        self.in_flight_step: int | None = None
        self.last_committed: int | None = None

    def steps(self) -> list[int]:
        if self.remote:  # only what the commit file marks, whatever Orbax lists
            return rundir.committed_steps(self.directory)
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: PyTree, iterator: Any, *, wait: bool = False,
             metrics: dict[str, float] | None = None) -> Location:
        """Checkpoint ``state`` after ``step`` steps. Blocks while the state is copied to host
        (the caller may donate it afterwards); the write continues in the background unless
        ``wait`` or ``async: false``. metrics: what ``keep_best`` ranks this step by."""
        path = self.directory / str(step)
        self._wait_watched()  # Orbax waits for the save before; on a bucket it is watched
        if step not in self.manager.all_steps():
            items: dict[str, ocp.args.CheckpointArgs] = {
                "state": StateSave(state),
                "meta": MetaSave(self._metadata(step, state, iterator))}
            if has_position(iterator):
                items["data"] = DataSave(iterator)
            self._watched(step, lambda: self.manager.save(
                step, args=ocp.args.Composite(**items), force=True, metrics=metrics))
            self._in_flight, self.in_flight_step = True, step
        if wait:
            self.manager.wait_until_finished()
        return path

    def _metadata(self, step: int, state: PyTree, iterator: Any) -> dict[str, Any]:
        return {
            "step": step,
            "config": self.config.to_dict(),
            "config_digest": self.config.digest(),
            "provenance": self.provenance,
            "key_impls": key_impls(state),
            "data_position": has_position(iterator),
            "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }

    def restore(self, target: PyTree, iterator: Any,
                check: Callable[[dict[str, Any]], None]) -> Restored | None:
        """The newest readable checkpoint restored into ``target`` (abstract arrays with the
        shardings the state must have) and ``iterator``; None when there is none.

        check: called with a step's metadata before its arrays are read; raises to refuse it
            (a changed config).
        """
        step, found, unreadable = newest_readable(
            self.steps(), lambda s: self._read(s, target, iterator, check))
        if step is None or found is None:  # found: a step was read
            if unreadable:
                raise CheckpointError(
                    f"no checkpoint in {self.directory} can be read: "
                    + "; ".join(f"step {s}: {why}" for s, why in unreadable)
                    + ". Pass --fresh to move this run aside and start over")
            return None
        meta, restored, saved_position, verified = found
        if not saved_position and iterator is not None:
            for _ in range(step):  # no saved position: replay the iterator up to it
                next(iterator)
        moved = [(s, why, self._move_aside(s)) for s, why in unreadable]
        return Restored(step, restored["state"], meta, moved, verified.checked)

    def _read(self, step: int, target: PyTree, iterator: Any,
              check: Callable[[dict[str, Any]], None],
              ) -> tuple[dict[str, Any], Any, bool, integrity.Verified]:
        """Step ``step`` loaded (``_load``) once its files' checksums match; ``Unreadable``
        when they do not."""
        step_dir = self.directory / str(step)
        if not self.remote:  # checked first: nothing of a changed step is read
            verified = integrity.verify_step(step_dir)
            if verified.problems:  # a changed or missing file: as unreadable as a torn one
                raise Unreadable("; ".join(verified.problems[:2]))
            return (*self._load(step, target, iterator, check), verified)
        # On object storage every byte is read twice, once to check it: both at once, and
        # nothing read is used unless every checksum matches.
        with ThreadPoolExecutor(1) as pool:
            checking = pool.submit(integrity.verify_step, step_dir, read=False)
            try:
                loaded = self._load(step, target, iterator, check)
            except BaseException:
                if checking.result().problems:
                    raise Unreadable("; ".join(checking.result().problems[:2])) from None
                raise
            verified = checking.result()
        if verified.problems:
            raise Unreadable("; ".join(verified.problems[:2]))
        return (*loaded, verified)

    def _load(self, step: int, target: PyTree, iterator: Any,
              check: Callable[[dict[str, Any]], None]) -> tuple[dict[str, Any], Any, bool]:
        """Step ``step``'s metadata, its state restored into ``target`` (and its data position
        into ``iterator`` when it saved one), and whether it did; refused by ``check`` or when
        its arrays are not ``target``'s."""
        meta = readable(lambda: self._restore(step, meta=MetaRestore())["meta"])
        saved_tree = readable(lambda: self.manager.item_metadata(step)["state"].tree)
        check(meta)
        differences = leaf_differences(saved_tree, target, meta.get("key_impls", {}))
        if differences:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds a different model: "
                f"{'; '.join(differences[:3])}"
                f"{f' (and {len(differences) - 3} more)' if len(differences) > 3 else ''}. "
                "Train it with the config it was written with, or pass --fresh to move "
                "this run aside (or --run-dir for a new one)")
        items: dict[str, ocp.args.CheckpointArgs] = {"state": StateRestore(target)}
        saved_position = has_position(iterator) and meta.get("data_position", True)
        if saved_position:
            items["data"] = DataRestore(iterator)
        return meta, readable(lambda: self._restore(step, **items)), saved_position

    def _restore(self, step: int, **items: Any) -> Any:
        return self.manager.restore(step, args=ocp.args.Composite(**items))

    def _move_aside(self, step: int) -> Location:
        """An unreadable step goes to ``corrupt/`` (process 0 moves it; all wait for that)."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
        target = self.directory / CORRUPT_DIR / f"{step}-{stamp}"
        if jax.process_index() == 0:
            (self.directory / str(step)).move_tree(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"trainrun: moved step {step} aside")
        self.manager.reload()
        return target

    def wait(self) -> None:
        self._wait_watched()
        self.manager.wait_until_finished()
        self._committed()

    def _committed(self) -> None:
        if self.in_flight_step is not None:
            self.last_committed, self.in_flight_step = self.in_flight_step, None

    def _wait_watched(self) -> None:
        """On object storage, wait for a save in flight while watching the store (``_watched``);
        every ``PROGRESS_S`` the console says what is still uploading."""
        if not (self.remote and self.stalled is not None and self._in_flight):
            return
        start = said = time.monotonic()
        while self.manager.is_saving_in_progress():
            self._give_up_if_stalled()
            now = time.monotonic()
            if self.say is not None and now - said >= PROGRESS_S:
                said = now
                self.say(f"waiting for checkpoint step {self.in_flight_step} to finish "
                         f"uploading to {self.directory} ({now - start:.0f} s so far)")
            time.sleep(0.05)
        self._committed()

    def _watched(self, step: int, call: Callable[[], Any]) -> None:
        """``call()`` (Orbax's save, which creates the step's folder on the store before it
        hands the rest to its thread); on object storage in a thread of its own, watched: a
        mirror that failed (the store gone past storage.deadline_s) ends the wait."""
        if not (self.remote and self.stalled is not None):
            call()
            return
        failed: list[BaseException] = []

        def target() -> None:
            try:
                call()
            except BaseException as err:
                failed.append(err)

        worker = threading.Thread(target=target, name=f"trainrun-save-{step}", daemon=True)
        worker.start()
        start = said = time.monotonic()
        while worker.is_alive():
            self._give_up_if_stalled()
            worker.join(0.05)
            now = time.monotonic()
            if self.say is not None and now - said >= PROGRESS_S:
                said = now
                self.say(f"waiting for checkpoint step {step} to start uploading to "
                         f"{self.directory} ({now - start:.0f} s so far)")
        if failed:
            raise failed[0]

    def _give_up_if_stalled(self) -> None:
        """Raise the mirror's failure, giving up the save in flight (``abandoned()``): closing
        would wait for a store that does not answer."""
        failure = self.stalled(self.last_committed) if self.stalled is not None else None
        if failure is not None:
            _ABANDONED.set()
            self._closed = True
            self._unquiet()
            raise failure

    def saving(self) -> bool:
        """Whether a save is still being written in the background (asked once a call: cheap
        when none was started)."""
        if self._in_flight and not self._closed:
            self._in_flight = self.manager.is_saving_in_progress()
            if not self._in_flight:
                self._committed()
        return self._in_flight and not self._closed

    def best(self) -> dict[str, Any] | None:
        """``{"step": s, <keep_best metric>: value}`` of the best checkpoint kept, or None."""
        if not self.cfg.keep_best:
            return None
        step = self.manager.best_step()
        metrics = self.manager.metrics(step) if step is not None else None
        return {"step": step, **metrics} if metrics else None

    def close(self) -> None:
        """Waits for a save in flight to commit, then releases Orbax's threads. Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                self.manager.close()
            finally:
                self._unquiet()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, kind: object, err: object, tb: object) -> None:
        if isinstance(err, BaseException) and (isinstance(err, WriteFailed)
                                               or write_failures.refused_write(err)):
            write_failures.quiet_after_refused_write()  # its save's threads report on
        if (self.remote and isinstance(err, WriteFailed) and not self._closed
                and self.manager.is_saving_in_progress()):
            _ABANDONED.set()  # the store is lost: closing would wait for it without end
            self._closed = True
            self._unquiet()
            return
        self.close()


PROGRESS_S = 10.0  # seconds between the lines of a wait for an upload
_ABANDONED = threading.Event()


def abandoned() -> bool:
    """Whether this process gave up on a save the store stopped answering: Orbax's thread for
    it still waits, so the process ends without joining it (``cli.main``)."""
    return _ABANDONED.is_set()


def _reason(err: Exception) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


# ---- what a checkpoint must match ------------------------------------------------------------


def _name(path: tuple[Any, ...]) -> str:
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
    return ".".join(parts)


def key_impls(state: PyTree) -> dict[str, str]:
    """{leaf name: key dtype, e.g. ``key<fry>``} for the typed PRNG keys in ``state``: Orbax
    stores their key data, so the implementation is recorded beside it."""
    return {_name(path): str(leaf.dtype)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)}


def _described(tree: PyTree) -> dict[str, tuple[tuple[int, ...], str]]:
    """{leaf name: (shape, dtype)} with typed keys as the key data Orbax stores."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        out[_name(path)] = (tuple(leaf.shape), str(leaf.dtype))
    return out


def leaf_differences(saved_tree: PyTree, target: PyTree, saved_impls: dict[str, str]) -> list[str]:
    """How a checkpoint's state differs from what this run builds, leaf by leaf, in the run's
    leaf order; empty when it can be restored."""
    saved, wanted = _described(saved_tree), _described(target)
    out = []
    for name, (shape, dtype) in wanted.items():
        if name not in saved:
            out.append(f"{name} {dtype}{list(shape)} is not in the checkpoint")
        elif saved[name] != (shape, dtype):
            have = saved[name]
            out.append(f"{name} is {have[1]}{list(have[0])} in the checkpoint, "
                       f"{dtype}{list(shape)} here")
    out += [f"{name} is in the checkpoint but not in this model" for name in saved
            if name not in wanted]
    for name, impl in key_impls(target).items():
        if saved_impls.get(name, impl) != impl:
            out.append(f"{name} is a {saved_impls[name]} key in the checkpoint, {impl} here")
    return out
