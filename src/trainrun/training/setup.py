"""Set-up: what a run needs, built once before its first step (``setup``), and its hooks.

    mesh, batch placement -> model, optimizer, precision -> abstract state and its shardings
    -> data -> evaluator -> step program compiled on shapes -> init.from's state
    -> run directory claimed -> checkpoints -> state (restored or fresh) -> writers

Every input is checked (mesh, model, data, init.from's source, the memory the state and the
compiled step need) before anything is written; a refusal after the claim has the run
(``loop.run``) withdraw it. ``Run`` is the frozen
record of what set-up made; ``build_hooks`` lists what acts between the calls (``hooks.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import grain
import jax
import jax.numpy as jnp
import numpy as np

from trainrun import extras, rundir
from trainrun.checkpointing import init_from
from trainrun.checkpointing.checkpoints import STEP_METADATA, Checkpoints, checkpoint_dir
from trainrun.checkpointing.policy import CheckpointPolicy
from trainrun.checkpointing.resume import check_config, provenance_changes, schedule_shift
from trainrun.config import ConfigError, RunConfig, TransformerModel, schedule_notices
from trainrun.data import (
    batch_iterator,
    build_dataset,
    build_eval_dataset,
    data_counts,
    data_notices,
)
from trainrun.fast import strategies
from trainrun.fast.strategies import Strategies
from trainrun.models import Model, build_model
from trainrun.platform import distributed
from trainrun.platform.process import calls_run_inline, require_backend
from trainrun.program import sharding
from trainrun.program.compiled import CompiledSteps
from trainrun.program.decode import HeadLayout
from trainrun.program.optim import Optimizer, build_optimizer
from trainrun.program.precision import Policy, policy_from_config
from trainrun.program.state import TrainState, abstract_state, init_state
from trainrun.reporting.console import Console, make_console
from trainrun.reporting.provenance import provenance
from trainrun.reporting.run_output import RunOutput, build_output
from trainrun.reporting.stream import MetricStream
from trainrun.reporting.timing import StepTimer, Stopwatch
from trainrun.rundir import location, remote
from trainrun.rundir.lock import refuse_joining
from trainrun.rundir.remote_run import RemoteRunDirectory, RunMirror
from trainrun.training import preflight
from trainrun.training.answers import answer_scorer
from trainrun.training.callbacks import Callback, CallbackHook
from trainrun.training.checkpoint_hook import CheckpointHook
from trainrun.training.evaluation import EvalHook, Evaluator
from trainrun.training.hooks import Hook
from trainrun.training.metric_log import MetricLog
from trainrun.training.nonfinite import NonFinitePolicy
from trainrun.training.preemption import Preemption
from trainrun.training.profiling import ProfileWindow
from trainrun.training.storage_hook import StorageHook
from trainrun.training.summary import RunSummary


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """What set-up made for a run, built once: its parts and the state its first call takes."""

    config: RunConfig
    run_dir: Path
    primary: bool  # process 0: the one that writes files and prints
    provenance: dict[str, Any]
    console: Console
    output: RunOutput
    model: Model
    counted: Any  # the config's model (an analytic FLOP count), None for a model passed in
    abstract: TrainState
    placement: sharding.BatchPlacement
    batches: Any  # this process's host batches (checkpointable position when it has one)
    evaluator: Evaluator | None
    checkpoints: Checkpoints
    programs: CompiledSteps
    start_state: Any  # the state as the calls carry it (``programs.carry``)
    start_step: int
    start_nonfinite: int
    batch_size: int
    watch: Stopwatch
    timer: StepTimer
    stream: MetricStream | None
    strategies: Strategies  # the seams' strategies, chosen once (fast/strategies.py)
    mirror: RunMirror | None  # uploads a run on object storage from its stage (process 0)

    def params_copy(self, state: TrainState) -> Any:
        """Params that the next call cannot donate away (a carrier's fresh arrays already are)."""
        if self.programs.carrier.fresh_arrays:
            return state.params
        return jax.tree.map(jnp.copy, state.params)


def run_directory(config: RunConfig, run_dir: Any, fresh: bool) -> rundir.RunDirectory:
    """The run's folders (run and checkpoints), to be checked, claimed and locked; a run
    directory on object storage is written through a local stage (``rundir/remote_run.py``)."""
    if location.is_remote(run_dir):
        url = location.location(run_dir)
        remote.set_deadline(config.storage.deadline_s)
        return RemoteRunDirectory(url, checkpoint_dir(config, url), fresh,
                                  lease_s=config.storage.lease_s,
                                  sync_every_s=config.storage.sync_every_s)
    return rundir.RunDirectory(run_dir, checkpoint_dir(config, run_dir), fresh)


def setup(config: RunConfig, run_dir: Path, directory: rundir.RunDirectory, *,
          model: Model | None, data: Any, eval_data: grain.MapDataset | None,
          allow_config_change: bool, out: TextIO, cleanup: contextlib.ExitStack,
          ) -> Run | RunSummary:
    """A run ready for its first call; a finished run's summary when there is nothing to do."""
    chosen = strategies.chosen()  # an unknown name in the switch is refused before anything
    # before anything asks JAX for devices; not into a job that runs in this directory already
    distributed.initialize(config.distributed, lambda: refuse_joining(directory.run_dir))
    require_backend()  # a platform this machine lacks is one line, not JAX's traceback
    # Inline CPU calls are the process's setting (configure_process): record what is in effect.
    inline = calls_run_inline()
    chosen = chosen.with_inline_calls(inline)
    primary = jax.process_index() == 0
    prov = provenance(config.digest(), chosen.on())
    if primary:  # a folder that is not trainrun's, or is in use, is refused; nothing written
        directory.check()
    batch_size = getattr(data, "batch_size", None) or config.data.batch_size
    seq_len = getattr(config.data, "seq_len", None)  # the console counts tokens or examples
    console = make_console(config.steps, batch_size * (seq_len or 1),
                           out if primary else open(os.devnull, "w"),  # noqa: SIM115
                           "tokens" if seq_len else "examples")
    committed = rundir.committed_steps(directory.ckpt_dir)
    latest = committed[-1] if committed else None
    if latest is not None and latest >= config.steps and not directory.fresh:
        console.message(rundir.finished_message(directory.display, latest, config.steps))
        return RunSummary.from_dict(rundir.read_summary(run_dir))
    if config.checkpoint.keep_best and not config.eval.every:
        raise ConfigError(f"checkpoint.keep_best={config.checkpoint.keep_best} needs "
                          "evaluations to rank checkpoints by: set eval.every")
    mesh = sharding.build_mesh(config.mesh)
    placement = sharding.batch_placement(mesh, batch_size, stacked=config.steps_per_call > 1)
    counted = None if model else config.model
    if model is None and isinstance(config.model, TransformerModel):  # before it is built
        preflight.check_model_memory(
            config.model, list(mesh.devices.flat), config.precision.params,
            f"the model of init.from {config.init.from_}" if config.init.from_ else "the model")
    model = model or build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    for notice in schedule_notices(config):
        console.message(f"warning: {notice}")
    policy = policy_from_config(config.precision)
    abstract = abstract_state(model, optimizer, config.seed, policy)
    state_sharding = sharding.state_shardings(mesh, abstract, model.logical_axes, optimizer.tx,
                                              config.mesh)
    preflight.check_state_memory(abstract, state_sharding)  # before data or state is made
    records = None
    if data is None:
        data = build_dataset(config.data, seed=config.seed, process_index=placement.rows[0],
                             process_count=placement.rows[1])
        for notice in data_notices(config.data):
            console.message(notice)
        records = data_counts(config.data)
        if records is not None:
            preflight.check_vocab(records.vocab, config.model, config.data)
    preflight.check_batch(model, data, abstract.params, from_config=counted is not None)
    if config.init.from_ is not None:  # a source that is not there is refused before claiming
        init_from.source_kind(init_from.source_location(config.init.from_))
    batches = (batch_iterator(data, config.data.prefetch_threads)
               if isinstance(data, grain.MapDataset) else iter(data))
    evaluator = _evaluator(config, model, policy, mesh, eval_data, state_sharding.params,
                           state_sharding.model_state, chosen.decode_head())
    _require_writers(config)
    watch = Stopwatch()
    stream = MetricStream() if config.metrics.stream else None  # its writers come after the claim
    # Batches a source holds are cut at the data position less the state's step: 0 unless a
    # checkpoint says otherwise (then the programs are built again below).
    source = chosen.batch_source(batches, mesh.size == 1)
    compiled_steps = functools.partial(
        CompiledSteps, model, optimizer, config.steps_per_call, watch, abstract=abstract,
        accumulate=config.accumulate, policy=policy, state_sharding=state_sharding,
        batch_sharding=placement.sharding, stream=stream,
        carrier=chosen.state_carrier(abstract), keep=chosen.nonfinite_guard(config.steps_per_call))
    programs = compiled_steps(source=source)
    # The step is compiled on shapes alone, before any state exists, and its memory checked;
    # the first call runs that executable.
    _check_program_memory(programs, config, data, placement, mesh,
                          start=0 if directory.fresh or latest is None else latest)
    loaded = None
    if config.init.from_ is not None and (directory.fresh or latest is None):
        with watch.phase("init"):  # the source is loaded, or refused, before the claim
            loaded = _fresh_state(config, model, optimizer, policy, state_sharding, abstract)
    if primary:  # creates, locks and marks the folders (moves an old run aside: --fresh)
        for notice in directory.claim():
            console.message(notice)
    checkpoints = cleanup.enter_context(Checkpoints(directory.ckpt_dir, config, prov))
    mirror = getattr(directory, "mirror", None) if primary else None
    if mirror is not None:  # a wait for an upload ends when the store is lost, and says so
        checkpoints.stalled = lambda: mirror.stopped(checkpoints.last_committed)
        checkpoints.say = console.message
        remote.set_notice(console.message)
        cleanup.callback(remote.set_notice, None)
    with watch.phase("init"):
        state = _restore_or_init(
            checkpoints, config, run_dir=run_dir, shown=directory.display, prov=prov,
            fresh=lambda: loaded if loaded is not None else _fresh_state(
                config, model, optimizer, policy, state_sharding, abstract),
            abstract=abstract, state_sharding=state_sharding, batches=batches,
            allow_config_change=allow_config_change, console=console, primary=primary)
    start = int(state.step)
    output = build_output(
        run_dir, console, log_every=config.metrics.every, total_steps=config.steps,
        primary=primary, start_step=start, tensorboard=config.metrics.tensorboard,
        wandb=config.metrics.wandb, wandb_project=config.metrics.wandb_project,
        config=config.to_dict(), name=config.name)
    if primary:
        rundir.write_status(run_dir, "running", start)
    if records is not None:  # what became of the records: on the console and in the metrics
        console.message(f"data: {records.summary()}")
        if start == 0:
            output.write(0, records.metrics(), split="data")
    if stream is not None:
        stream.output = output
    moved = source.from_offset(getattr(batches, "next_index", 0) - start)
    if moved is not source:
        programs = compiled_steps(source=moved)
    console.message(f"training {model.name} for {config.steps} steps, "
                    f"{config.steps_per_call} per call -> {directory.display}")
    return Run(config=config, run_dir=run_dir, primary=primary, provenance=prov,
               console=console, output=output, model=model, counted=counted,
               abstract=abstract, placement=placement, batches=batches,
               evaluator=evaluator, checkpoints=checkpoints, programs=programs,
               start_state=programs.carry(state), start_step=start,
               start_nonfinite=int(state.nonfinite_steps), batch_size=batch_size,
               watch=watch, timer=StepTimer(inline=inline), stream=stream,
               strategies=chosen, mirror=mirror)


def build_hooks(run: Run, preemption: Preemption,
                callbacks: list[Callback]) -> tuple[list[Hook], MetricLog]:
    """The run's hooks, in the order they act at every boundary (``hooks.py``), and the metric
    log among them (the loop finishes it last)."""
    config, watch = run.config, run.watch

    def before_halt() -> None:  # the last good checkpoint commits; the files are closed
        log.finish()
        run.checkpoints.wait()
        run.checkpoints.close()

    log = MetricLog(run.output, run.timer, watch, run.batch_size,
                    streamed=run.stream is not None,
                    writes=run.strategies.metric_writes())
    output = log.ordered  # every later write is timed as logging
    hooks: list[Hook] = [
        log, NonFinitePolicy(config.nonfinite, output, run.start_nonfinite, before_halt)]
    if config.profile.steps and run.primary:
        hooks.append(ProfileWindow(config.profile.steps, run.run_dir, say=output.message,
                                   watch=watch))
    if run.evaluator is not None:
        hooks.append(EvalHook(run.evaluator, output, watch, config.steps, config.eval.params))
    hooks.append(preemption)
    for callback in callbacks:
        hook = CallbackHook(callback, watch)
        if 0 < hook.every < config.steps_per_call:  # it cuts every call: say so
            output.message(f"{type(callback).__name__} asks for a boundary every {hook.every} "
                           f"step(s): calls run {hook.every} step(s), not steps_per_call="
                           f"{config.steps_per_call}")
        hooks.append(hook)
    policy = CheckpointPolicy(config.checkpoint.every, config.checkpoint.every_seconds,
                              check_every=config.metrics.every)
    if run.mirror is not None:  # a run on object storage: its files go up before each save
        mirror, checkpoints = run.mirror, run.checkpoints
        hooks.append(StorageHook(lambda: mirror.stopped(checkpoints.last_committed)))
    hooks.append(CheckpointHook(run.checkpoints, policy, run.batches, log, watch,
                                keep_best=config.checkpoint.keep_best,
                                listeners=[c.on_checkpoint for c in callbacks],
                                before_save=None if run.mirror is None else lambda: (
                                    mirror.sync_before_save(checkpoints.last_committed))))
    return hooks, log


def _evaluator(config: RunConfig, model: Model, policy: Policy, mesh: Any,
               eval_data: grain.MapDataset | None, params_sharding: Any,
               model_state_sharding: Any, head: HeadLayout) -> Evaluator | None:
    """The evaluator (None when ``eval.every`` is 0): its batches are this process's rows of
    the held-out split, placed on the mesh as training batches are."""
    if not config.eval.every:
        return None
    size = config.eval.batch_size or config.data.batch_size
    placement = sharding.batch_placement(mesh, size, stacked=False)
    if eval_data is None:
        eval_data = build_eval_dataset(config.data, size, process_index=placement.rows[0],
                                       process_count=placement.rows[1])
    return Evaluator(model, eval_data, config.eval.every, max_batches=config.eval.batches,
                     policy=policy, put=placement.put,
                     shardings=(params_sharding, placement.sharding, model_state_sharding),
                     answers=answer_scorer(config, head) if config.eval.generate else None)


def _check_program_memory(programs: CompiledSteps, config: RunConfig, data: Any,
                          placement: sharding.BatchPlacement, mesh: Any, start: int) -> None:
    """Compile the program of the run's usual call (K steps, or what is left from ``start``) on
    the shapes of the state and of the data's first batch, and refuse it if its buffers do not
    fit (``preflight.check_program_memory``). Data that is a plain iterator cannot be looked
    at: its program is compiled at the first call, unchecked."""
    k = min(config.steps_per_call, config.steps - start)
    batch = programs.source.held(k)  # None: host batches, shaped as the data's first
    if batch is None:
        if not isinstance(data, grain.MapDataset):
            return
        stacked = config.steps_per_call > 1
        batch = jax.tree.map(lambda leaf: _global_shape(np.asarray(leaf), placement, k, stacked),
                             data[0])
    compiled = programs.compile(k, programs.carried_shapes(), batch)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    preflight.check_program_memory(compiled, local, k)


def _global_shape(leaf: np.ndarray, placement: sharding.BatchPlacement, k: int,
                  stacked: bool) -> jax.ShapeDtypeStruct:
    """The global batch a call takes, for this process's rows ``leaf`` of one batch: placed
    as ``placement.put`` places it (one process: host arrays, placed by the call itself)."""
    rows = (placement.global_size, *leaf.shape[1:])
    return jax.ShapeDtypeStruct((k, *rows) if stacked else rows, leaf.dtype,
                                sharding=placement.sharding if jax.process_count() > 1 else None)


def _require_writers(config: RunConfig) -> None:
    """The metric writers' extras, asked for before the claim (the writers open after it)."""
    if config.metrics.tensorboard:
        extras.require("tensorboard", "metrics.tensorboard=true")
    if config.metrics.wandb != "off":
        extras.require("wandb", f"metrics.wandb={config.metrics.wandb}")


def _fresh_state(config: RunConfig, model: Model, optimizer: Optimizer, policy: Policy,
                 state_sharding: TrainState, abstract: TrainState) -> TrainState:
    """The state a run without a checkpoint starts from: random init, or ``init.from``'s
    source placed where the state goes (loaded, or refused, before anything is written)."""
    if config.init.from_ is not None:
        return jax.block_until_ready(init_from.initial_state(
            config, model, optimizer, policy, state_sharding, abstract))
    return jax.block_until_ready(
        init_state(model, optimizer, config.seed, policy, state_sharding))


def _restore_or_init(checkpoints: Checkpoints, config: RunConfig, *, run_dir: Path, shown: Any,
                     prov: dict[str, Any], fresh: Callable[[], TrainState],
                     abstract: TrainState, state_sharding: TrainState, batches: Any,
                     allow_config_change: bool, console: Console, primary: bool) -> TrainState:
    """The newest readable checkpoint's state, placed by ``state_sharding`` (any mesh), with the
    data iterator set to its position; else a fresh state. Then the run's files are written
    for the step it starts at (nothing is written before a refusal)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, state_sharding)
    changes: list[str] = []
    restored = checkpoints.restore(target, batches, lambda meta: changes.extend(
        check_config(meta["config"], config, allow_config_change, shown)))
    if restored is None:
        state = fresh()
        step = int(state.step)
    else:
        state, step = restored.state, restored.step
        checkpoints.last_committed = step
    if primary:
        rundir.start(run_dir, config, prov, step)
    for name in checkpoints.partial:
        console.message(f"removing {name}: a checkpoint whose save never finished")
    for name in checkpoints.repaired:
        console.message(f"rewrote step {name}'s {STEP_METADATA}: Orbax's record of the step "
                        "could not be read (the step's own files are checked by their "
                        "checksums)")
    for name in checkpoints.half_deleted:
        console.message(f"removed the rest of step {name}: an old checkpoint whose deletion "
                        "was cut short")
    if restored is None:
        if config.init.from_ is not None:
            console.message(f"starting from {config.init.load} of {config.init.from_} "
                            f"(init.from) at step {step}")
        return state
    for bad, why, where in restored.moved:
        console.message(f"warning: checkpoint step {bad} cannot be read ({why}); "
                        f"moved it to {where}")
    if not restored.verified:
        console.message(f"checkpoint step {step} has no checksums (saved by an earlier "
                        "trainrun): restored without verifying its files")
    if changes:
        console.message("warning: resuming with a changed config (--allow-config-change): "
                        + "; ".join(changes))
    shift = schedule_shift(restored.metadata["config"], config, step)
    if shift is not None:
        console.message(f"warning: the learning-rate schedule spans the run's length: with "
                        f"steps={config.steps} (was {restored.metadata['config']['steps']}) it "
                        f"differs from step {shift} on, so this run matches no uninterrupted one")
    drift = provenance_changes(restored.metadata.get("provenance", {}), prov)
    if drift:
        console.message(f"warning: the checkpoint was written with other {', '.join(drift)}; "
                        "bitwise equality with an uninterrupted run is not promised across that")
    console.message(f"resumed from step {step} ({checkpoints.directory / str(step)})")
    return state
