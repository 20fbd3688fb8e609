"""The state a run starts from: the newest readable checkpoint's, restored with its data
position once its config and data files are checked against the run's, or a fresh one (random
init, or ``init.from``'s source made the kind's); and what set-up says of either on the console
(unfinished saves cleaned up, a changed config or data, a shifted schedule, other versions)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from trainrun import rundir
from trainrun.checkpointing import init_from
from trainrun.checkpointing.checkpoints import STEP_METADATA, Checkpoints, Restored
from trainrun.checkpointing.resume import (
    check_config,
    check_data,
    provenance_changes,
    schedule_shift,
)
from trainrun.config import RunConfig, TransformerModel
from trainrun.data.kept_tokenizer import kept_files
from trainrun.models.transformer import embedding_rows
from trainrun.program.state import TrainState, init_state
from trainrun.reporting.console import Console
from trainrun.storage.location import LocalLocation
from trainrun.training.background_init import BackgroundInit
from trainrun.training.kinds.base import RunKind
from trainrun.training.run_parts import Parts


def fresh_state(config: RunConfig, parts: Parts, kind: RunKind,
                readying: BackgroundInit | None = None) -> TrainState:
    """The state a run without a checkpoint starts from: random init (``readying``: its
    program compiling, or its state being built, already), or ``init.from``'s source placed
    where the state goes (loaded, or refused, before anything is written)."""
    if config.init.from_ is not None:
        state = init_from.initial_state(config, parts.model, parts.optimizer, parts.policy,
                                        parts.state_sharding, parts.abstract)
        return jax.block_until_ready(kind.started(state))
    if readying is not None:
        return jax.block_until_ready(readying.result()())
    return jax.block_until_ready(init_state(
        parts.model, parts.optimizer, config.seed, parts.policy, parts.state_sharding,
        op_by_op=parts.init_op_by_op))


@dataclasses.dataclass(frozen=True)
class Resuming:
    """What the start of the run's files, its checks on resume and its console messages
    need."""

    run_dir: LocalLocation
    shown: Any  # the run directory as messages show it
    provenance: dict[str, Any]
    console: Console
    primary: bool
    data_files: dict[str, str] | None  # None: data given as a dataset, no files to compare
    allow_config_change: bool
    allow_data_change: bool
    kind: RunKind
    tokenizer: dict[str, str] | None = None  # its files; None: data read without one

    def changes(self, config: RunConfig, meta: dict[str, Any]) -> tuple[list[str], list[str]]:
        """The config's and the data files' differences from what the checkpoint's run trained
        on; raises for either unless allowed. Process 0 holds the run's files, and checks the
        data files."""
        configs = check_config(meta["config"], config, self.allow_config_change, self.shown)
        if not self.primary or self.data_files is None:
            return configs, []
        kept = kept_files(self.run_dir) if self.tokenizer is not None else None
        return configs, check_data(rundir.read_data_files(self.run_dir), self.data_files,
                                   self.allow_data_change, self.shown,
                                   tokenizer_changed=kept is not None and kept != self.tokenizer)


def restore_or_init(checkpoints: Checkpoints, config: RunConfig, parts: Parts, batches: Any,
                    loaded: TrainState | None, init_readying: BackgroundInit | None,
                    resuming: Resuming) -> TrainState:
    """The newest readable checkpoint's state, placed by the state's shardings (any mesh), with
    the data iterator set to its position, once its config and the data files are checked
    against the run's; else a fresh state (``loaded``: init.from's, made already;
    ``init_readying``: its init, readied since before the claim). Then the
    run's files are written for the step it starts at, the data files' fingerprints among
    them (nothing is written before a refusal)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          parts.abstract, parts.state_sharding)
    changes: list[str] = []
    data_changes: list[str] = []

    def check(meta: dict[str, Any]) -> None:  # each step tried: the last one's are said
        changes[:], data_changes[:] = resuming.changes(config, meta)

    restored = checkpoints.restore(target, batches, check)
    if restored is None:
        state = (loaded if loaded is not None
                 else fresh_state(config, parts, resuming.kind, init_readying))
        step = int(state.step)
    else:
        state, step = restored.state, restored.step
        checkpoints.last_committed = step
    if resuming.primary:
        rundir.start(resuming.run_dir, config, resuming.provenance, step, resuming.data_files,
                     resuming.tokenizer)
    _say_cleanups(checkpoints, resuming.console)
    if restored is None:
        _say_fresh_start(config, resuming.console, step)
        return state
    _say_restored(restored, config, checkpoints, changes, data_changes, resuming)
    return state


def _say_fresh_start(config: RunConfig, console: Console, step: int) -> None:
    """What a run that starts afresh starts from, and what a transformer's embedding rows
    learn from their lookups."""
    if config.init.from_ is not None:
        console.message(f"starting from {config.init.load} of {config.init.from_} "
                        f"(init.from) at step {step}")
    if isinstance(config.model, TransformerModel):
        console.message(embedding_rows(config.model))


def _say_cleanups(checkpoints: Checkpoints, console: Console) -> None:
    """What the checkpoints' opening cleaned up: unfinished saves, records rewritten, deletions
    finished."""
    for name in checkpoints.partial:
        console.message(f"removing {name}: a checkpoint whose save never finished")
    for name in checkpoints.repaired:
        console.message(f"rewrote step {name}'s {STEP_METADATA}: Orbax's record of the step "
                        "could not be read (the step's own files are checked by their "
                        "checksums)")
    for name in checkpoints.half_deleted:
        console.message(f"removed the rest of step {name}: an old checkpoint whose deletion "
                        "was cut short")


def _say_restored(restored: Restored, config: RunConfig, checkpoints: Checkpoints,
                  changes: list[str], data_changes: list[str], resuming: Resuming) -> None:
    """What a resume passed over or differs in (unreadable steps, no checksums, a changed
    config, changed data files, a shifted schedule, other versions), then where it resumed
    from."""
    console, step = resuming.console, restored.step
    for bad, why, where in restored.moved:
        console.message(f"warning: checkpoint step {bad} cannot be read ({why}); "
                        f"moved it to {where}")
    if not restored.verified:
        console.message(f"checkpoint step {step} has no checksums (saved by an earlier "
                        "trainrun): restored without verifying its files")
    if changes:
        console.message("warning: resuming with a changed config (--allow-config-change): "
                        + "; ".join(changes))
    if data_changes:
        console.message("warning: resuming on changed data (--allow-data-change): "
                        + "; ".join(data_changes))
    _say_drift(restored, config, step, resuming)
    console.message(f"resumed from step {step} ({checkpoints.directory / str(step)})")


def _say_drift(restored: Restored, config: RunConfig, step: int, resuming: Resuming) -> None:
    """Where the resumed run stops matching an uninterrupted one: a schedule that spans the
    run's length, or other versions than the checkpoint's."""
    saved = restored.metadata["config"]
    shift = schedule_shift(saved, config, step)
    if shift is not None:
        resuming.console.message(
            f"warning: the learning-rate schedule spans the run's length: with "
            f"steps={config.steps} (was {saved['steps']}) it "
            f"differs from step {shift} on, so this run matches no uninterrupted one")
    drift = provenance_changes(restored.metadata.get("provenance", {}), resuming.provenance)
    if drift:
        resuming.console.message(
            f"warning: the checkpoint was written with other {', '.join(drift)}; "
            "bitwise equality with an uninterrupted run is not promised across that")
