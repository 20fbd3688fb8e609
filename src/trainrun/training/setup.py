"""Set-up: what a run needs, built once before its first step (``setup``), and its hooks.

    mesh, batch placement -> model, optimizer, precision -> abstract state and its shardings
    -> data -> evaluator -> step program compiled on shapes -> init.from's state
    -> run directory claimed -> checkpoints -> state (restored or fresh) -> writers
    -> the loop's runners: the hooks, the calls and the finish

Every input is checked (mesh, model, data, init.from's source, the memory the state and the
compiled step need) before anything is written; a refusal after the claim has the run
(``loop.run``) withdraw it. ``setup`` is the list of builders in that order, each returning
what it builds, in the bundles the loop's pieces take (``run_parts.py``); it returns
``Runners``, what the loop runs, each built whole. What differs by the kind of run (its model,
data, held-out data and evaluator, hooks) the run's kind gives (``kinds/``); the state it
starts from is ``restore.py``'s. ``run_directory`` is the one place that
asks whether a run is on object storage; ``build_hooks`` lists what acts between the calls
(``hooks.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import grain
import jax
import jax.numpy as jnp
import numpy as np

from trainrun import extras, rundir
from trainrun.checkpointing.checkpoints import (
    Checkpoints,
    checkpoint_dir,
)
from trainrun.checkpointing.policy import CheckpointPolicy, Clock
from trainrun.config import (
    BATCH_AXES,
    ConfigError,
    RunConfig,
    TransformerModel,
    schedule_notices,
)
from trainrun.data.kept_tokenizer import tokenizer_files
from trainrun.data.record_rows import RecordCounts
from trainrun.fast import strategies
from trainrun.fast.strategies import Strategies
from trainrun.models import Model
from trainrun.platform import distributed
from trainrun.platform.process import calls_run_inline, require_backend
from trainrun.program import sharding
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import (
    TrainState,
    abstract_state,
    compile_init,
    init_program,
    init_state,
)
from trainrun.reporting.console import Console, make_console
from trainrun.reporting.provenance import provenance
from trainrun.reporting.run_output import RunOutput, build_output
from trainrun.reporting.stream import MetricStream
from trainrun.reporting.timing import StepTimer, Stopwatch, Timing
from trainrun.rundir.lock import refuse_joining
from trainrun.rundir.remote_run import RemoteRunDirectory, RunMirror
from trainrun.storage import location, remote
from trainrun.storage.location import LocalLocation, Location
from trainrun.training import preflight
from trainrun.training.background_init import BackgroundInit, StateMaker
from trainrun.training.callbacks import Callback, CallbackHook
from trainrun.training.calls import CallRunner
from trainrun.training.checkpoint_hook import CheckpointHook
from trainrun.training.evaluation import EvalHook, EvalSchedule
from trainrun.training.finish import Finish
from trainrun.training.hooks import Hook, HookRunner
from trainrun.training.kinds import RunData, RunKind, kind_of
from trainrun.training.metric_log import MetricLog, OrderedOutput
from trainrun.training.metrics_reader import MetricsReader
from trainrun.training.nonfinite import NonFinitePolicy
from trainrun.training.preemption import Preemption
from trainrun.training.profiling import ProfileWindow
from trainrun.training.restore import Resuming, fresh_state, restore_or_init
from trainrun.training.run_parts import Parts, Reporting, Start
from trainrun.training.storage_hook import StorageHook
from trainrun.training.summary import RunSummary


@dataclasses.dataclass(frozen=True, kw_only=True)
class Runners:
    """What the loop runs, built by set-up: where the first call starts, the hooks that act
    between calls, the calls themselves, and the end that writes the summary."""

    start: Start
    hooks: HookRunner
    calls: CallRunner
    finish: Finish


def params_copier(programs: CompiledSteps) -> Callable[[TrainState], Any]:
    """Params that the next call cannot donate away (a carrier's fresh arrays already are)."""
    if programs.carrier.fresh_arrays:
        return lambda state: state.params
    return lambda state: jax.tree.map(jnp.copy, state.params)


def run_directory(config: RunConfig, run_dir: Path | str | Location | None,
                  fresh: bool) -> rundir.RunDirectory:
    """The run's folders (run and checkpoints), to be checked, claimed and locked: ``run_dir``,
    or the config's default. The one place that asks whether a run is on object storage: such
    a run is written through a local stage (``rundir/remote_run.py``)."""
    where = location.location(run_dir) if run_dir is not None else rundir.default_run_dir(config)
    path = where.local_path
    if path is None:
        return RemoteRunDirectory(where, checkpoint_dir(config, where), fresh,
                                  lease_s=config.storage.lease_s,
                                  sync_every_s=config.storage.sync_every_s,
                                  deadline_s=config.storage.deadline_s)
    # `--run-dir . --fresh`: the new run goes where `.` was, not into the old one
    here = location.local(os.path.abspath(path) if fresh else path)
    return rundir.RunDirectory(here, checkpoint_dir(config, here), fresh)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Asked:
    """What the caller of ``run`` passed besides the config and the run directory."""

    model: Model | None
    data: Any
    eval_data: grain.MapDataset | None
    out: TextIO
    allow_config_change: bool
    allow_data_change: bool
    callbacks: list[Callback]
    clock: Clock
    process_notice: str | None  # the process settings could not be applied: said once


def setup(config: RunConfig, directory: rundir.RunDirectory, asked: Asked,
          preemption: Preemption, cleanup: contextlib.ExitStack) -> Runners | RunSummary:
    """A run ready for its first call; a finished run's summary when there is nothing to do."""
    wall_start = time.perf_counter()
    watch = Stopwatch()
    run_dir = directory.run_dir
    chosen, primary, prov = _process(config, directory, watch)
    kind = kind_of(config)
    batch_size = getattr(asked.data, "batch_size", None) or kind.batch_size(config)
    console = _console(config, batch_size, asked.out if primary else None)
    resumes = _resume_step(directory)
    if resumes is not None and resumes >= config.steps:  # finished: nothing to do
        return _finished(run_dir, directory, resumes, config.steps, console, primary)
    parts = _parts(config, asked.model, batch_size, console, chosen, kind)
    found = kind.data(config, parts, console, asked.data, asked.eval_data)
    evaluator = (found.held_out.evaluator(config, parts, chosen.decode_head())
                 if config.eval.every else None)
    stream = _metric_stream(config)
    timing = _timing(chosen, found, watch)
    compiled_steps = _compiled_steps(config, parts, timing.watch, stream, chosen)
    init_readying = _init_readying(config, parts, resumes, timing.watch, cleanup)
    # a state being built meanwhile holds memory: the program is checked once it is placed
    programs = _checked_programs(compiled_steps, chosen, config, found, parts, resumes,
                                 check=not (init_readying is not None and parts.init_op_by_op))
    loaded = _init_from_state(config, parts, resumes, timing.watch, kind)
    checkpoints, mirror = _claim(config, directory, prov, primary, console, cleanup)
    with timing.watch.phase("init"):
        state = restore_or_init(checkpoints, config, parts, found.batches, loaded,
                                init_readying, Resuming(
                                    run_dir, directory.display, prov, console, primary,
                                    found.files, asked.allow_config_change,
                                    asked.allow_data_change, kind, _tokenizer(config, found,
                                                                              primary)))
    _check_call_memory(programs, state, config, found.dataset, parts, int(state.step))
    reporting = _reporting(config, run_dir, console, primary, prov, int(state.step),
                           kind.writes_completions(config))
    _report_start(config, reporting, found.records, stream, int(state.step), parts.model.name,
                  directory.display)
    programs = _at_data_position(compiled_steps, programs, found.batches, int(state.step))
    if asked.process_notice is not None:
        console.message(asked.process_notice)
    log = metric_log(reporting.output, timing, batch_size, stream is not None, chosen)
    start = _start(programs, state)
    hooks = HookRunner(
        build_hooks(config, reporting, log, timing.watch, checkpoints, data=found,
                    evaluator=evaluator, mirror=mirror, start_nonfinite=start.nonfinite,
                    preemption=preemption, callbacks=asked.callbacks, clock=asked.clock,
                    start_step=start.step, kind=kind),
        config.steps_per_call, config.steps,
        MetricsReader(programs, timing.timer, config.metrics.every), programs.state,
        params_copier(programs))
    follows = found.follow
    follow = None if follows is None else lambda carried: follows(programs.state(carried))
    calls = CallRunner(programs, found.batches, parts.placement, timing,
                       stacked=config.steps_per_call > 1, saving=checkpoints.saving,
                       reset_rate=reporting.output.reset_rate, follow=follow)
    finish = Finish(config=config, reporting=reporting, timing=timing, log=log, calls=calls,
                    checkpoints=checkpoints, programs=programs, counted=parts.counted,
                    batch_size=batch_size, start_step=start.step, streamed=stream is not None,
                    wall_start=wall_start)
    return Runners(start=start, hooks=hooks, calls=calls, finish=finish)


def _process(config: RunConfig, directory: rundir.RunDirectory, watch: Stopwatch,
             ) -> tuple[Strategies, bool, dict[str, Any]]:
    """This process in the job: the fast paths' strategies, whether it is process 0, and the
    run's provenance; process 0 checks the run's folder (a folder that is not trainrun's, or
    is in use, is refused; nothing written). JAX's backend starts here (a TPU runtime's start
    takes seconds): timed as the phase ``backend``, the job's joining included."""
    chosen = strategies.chosen()  # an unknown name in the switch is refused before anything
    with watch.phase("backend"):
        # before anything asks JAX for devices; not into a job that runs in this directory
        distributed.initialize(config.distributed, lambda: refuse_joining(directory.run_dir))
        require_backend()  # a platform this machine lacks is one line, not JAX's traceback
    # Inline CPU calls are the process's setting (configure_process): record what is in effect.
    chosen = chosen.with_inline_calls(calls_run_inline())
    primary = jax.process_index() == 0
    prov = provenance(config.digest(), chosen.on())
    if primary:
        directory.check()
    return chosen, primary, prov


def _timing(chosen: Strategies, data: RunData, watch: Stopwatch) -> Timing:
    """The run's clocks; the parts of each step its data draws on the host, where it does
    (``timing.HostParts``: a reinforcement-learning run's rollout batches)."""
    parts = data.host_parts
    return Timing(watch=watch,
                  timer=StepTimer(inline=chosen.switch.inline_cpu_calls, host=parts), parts=parts)


def _tokenizer(config: RunConfig, found: RunData, primary: bool) -> dict[str, str] | None:
    """The files of the tokenizer the run reads its data with, which process 0 keeps in the run
    (none for data given as a dataset)."""
    return tokenizer_files(config.data) if primary and found.files is not None else None


def _console(config: RunConfig, batch_size: int, out: TextIO | None) -> Console:
    """The console (``out`` None: a process other than 0, which prints nothing), counting
    tokens when the data has a sequence length, else examples."""
    seq_len = getattr(config.data, "seq_len", None)
    return make_console(config.steps, batch_size * (seq_len or 1),
                        open(os.devnull, "w") if out is None else out,
                        "tokens" if seq_len else "examples")


def _resume_step(directory: rundir.RunDirectory) -> int | None:
    """The newest committed checkpoint's step a run resumes from; None: it starts afresh."""
    committed = rundir.committed_steps(directory.ckpt_dir)
    return committed[-1] if committed and not directory.fresh else None


def _finished(run_dir: LocalLocation, directory: rundir.RunDirectory, latest: int, steps: int,
              console: Console, primary: bool) -> RunSummary:
    """The summary of a run whose last checkpoint is at its end: nothing runs. A process
    killed after committing that checkpoint, before recording its end, left the status
    ``running``: it is recorded ``finished`` now."""
    if primary and rundir.read_status(run_dir).get("status") != "finished":
        rundir.write_status(run_dir, "finished", latest)
    console.message(rundir.finished_message(directory.display, latest, steps))
    return RunSummary.from_dict(rundir.read_summary(run_dir))


def _parts(config: RunConfig, model: Model | None, batch_size: int, console: Console,
           chosen: Strategies, kind: RunKind) -> Parts:
    """The mesh, the model and its program's shapes, each checked against memory before the
    next is made."""
    if config.checkpoint.keep_best and not config.eval.every:
        raise ConfigError(f"checkpoint.keep_best={config.checkpoint.keep_best} needs "
                          "evaluations to rank checkpoints by: set eval.every")
    mesh = sharding.build_mesh(config.mesh)
    placement = sharding.batch_placement(mesh, batch_size, stacked=config.steps_per_call > 1)
    counted = None if model else config.model
    built = model or _model(config, mesh, chosen, kind)
    optimizer = build_optimizer(config.optimizer, config.steps)
    for notice in schedule_notices(config):
        console.message(f"warning: {notice}")
    policy = policy_from_config(config.precision)
    abstract = abstract_state(built, optimizer, config.seed, policy)
    state_sharding = sharding.state_shardings(mesh, abstract, built.logical_axes, optimizer.tx,
                                              config.mesh)
    preflight.check_state_memory(abstract, state_sharding,  # before data or state is made
                                 kind.state_holds)
    return Parts(mesh=mesh, placement=placement, model=built, counted=counted,
                 optimizer=optimizer, policy=policy, abstract=abstract,
                 state_sharding=state_sharding, init_op_by_op=chosen.init_op_by_op(mesh.size))


def _model(config: RunConfig, mesh: Any, chosen: Strategies, kind: RunKind) -> Model:
    """The model the run's kind trains; a transformer's memory is checked before it is
    built."""
    if isinstance(config.model, TransformerModel):
        preflight.check_model_memory(
            config.model, list(mesh.devices.flat), config.precision.params,
            f"the model of init.from {config.init.from_}" if config.init.from_ else "the model")
    return kind.model(config, chosen)


def _metric_stream(config: RunConfig) -> MetricStream | None:
    """The metric stream (``metrics.stream``), once the metric writers' extras are there:
    asked for before the claim, the writers open after it."""
    _require_writers(config)
    return MetricStream() if config.metrics.stream else None


def _compiled_steps(config: RunConfig, parts: Parts, watch: Stopwatch,
                    stream: MetricStream | None, chosen: Strategies,
                    ) -> Callable[..., CompiledSteps]:
    """The run's programs for a batch source (``source=``): batches a source holds are cut at
    the data position less the state's step, so a restored run builds them again."""
    return functools.partial(
        CompiledSteps, parts.model, parts.optimizer, config.steps_per_call, watch,
        abstract=parts.abstract, accumulate=config.accumulate, policy=parts.policy,
        state_sharding=parts.state_sharding, batch_sharding=parts.placement.sharding,
        stream=stream, carrier=chosen.state_carrier(parts.abstract),
        keep=chosen.nonfinite_guard(config.steps_per_call), norm=chosen.norm())


def _checked_programs(compiled_steps: Callable[..., CompiledSteps], chosen: Strategies,
                      config: RunConfig, data: RunData, parts: Parts,
                      resumes: int | None, check: bool = True) -> CompiledSteps:
    """The run's programs on its batch source (cut at data position 0), the usual call's
    compiled on shapes and (``check``) its memory checked (``_check_program_memory``) for the
    step the run starts at."""
    programs = compiled_steps(source=chosen.batch_source(data.batches, parts.mesh.size == 1))
    _check_program_memory(programs, config, data.dataset, parts, start=resumes or 0,
                          check=check)
    return programs


def _init_readying(config: RunConfig, parts: Parts, resumes: int | None, watch: Stopwatch,
                   cleanup: contextlib.ExitStack) -> BackgroundInit | None:
    """A fresh run's init readied in a thread while set-up compiles the step program
    (``background_init.py``): its program traced here and compiled there, or its state built
    there op by op (``Parts.init_op_by_op``); None for a run that resumes or starts from
    init.from's source."""
    if resumes is not None or config.init.from_ is not None:
        return None
    if parts.init_op_by_op:
        def built() -> StateMaker:
            state = init_state(parts.model, parts.optimizer, config.seed, parts.policy,
                               parts.state_sharding, op_by_op=True)
            return lambda: state
        readying = BackgroundInit(built)
    else:
        with watch.phase("init"):
            lowered = init_program(parts.model, parts.optimizer, config.seed, parts.policy,
                                   parts.state_sharding)
        readying = BackgroundInit(lambda: compile_init(lowered))
    cleanup.callback(readying.wait)
    return readying


def _init_from_state(config: RunConfig, parts: Parts, resumes: int | None,
                     watch: Stopwatch, kind: RunKind) -> TrainState | None:
    """init.from's state for a run that starts afresh: loaded, or refused, before the claim."""
    if config.init.from_ is None or resumes is not None:
        return None
    with watch.phase("init"):
        return fresh_state(config, parts, kind)


def _claim(config: RunConfig, directory: rundir.RunDirectory, prov: dict[str, Any],
           primary: bool, console: Console, cleanup: contextlib.ExitStack,
           ) -> tuple[Checkpoints, RunMirror | None]:
    """The folders claimed by process 0 (created, locked and marked; ``--fresh`` moves an old
    run aside), then the run's checkpoints, closed by ``cleanup``, and its mirror."""
    if primary:
        for notice in directory.claim():
            console.message(notice)
    mirror = directory.mirror if primary and isinstance(directory, RemoteRunDirectory) else None
    # a wait for an upload ends when the store is lost, and says so
    checkpoints = cleanup.enter_context(Checkpoints(
        directory.ckpt_dir, config, prov, stalled=None if mirror is None else mirror.stopped,
        say=None if mirror is None else console.message))
    if mirror is not None:  # a request that keeps failing is said on the console
        cleanup.enter_context(remote.notices(console.message))
    return checkpoints, mirror


def _reporting(config: RunConfig, run_dir: LocalLocation, console: Console, primary: bool,
               prov: dict[str, Any], start: int, completions: bool) -> Reporting:
    """The run's metric writers opened at the step it starts at, and its status "running"."""
    output = build_output(
        run_dir, console, log_every=config.metrics.every, total_steps=config.steps,
        primary=primary, start_step=start, tensorboard=config.metrics.tensorboard,
        wandb=config.metrics.wandb, wandb_project=config.metrics.wandb_project,
        config=config.to_dict(), name=config.name,
        completions=completions)
    if primary:
        rundir.write_status(run_dir, "running", start)
    return Reporting(run_dir=run_dir, primary=primary, provenance=prov, console=console,
                     output=output)


def _report_start(config: RunConfig, reporting: Reporting, records: RecordCounts | None,
                  stream: MetricStream | None, start: int, model_name: str, shown: Any) -> None:
    """What became of the records, on the console and in the metrics (a fresh run's); the
    metric stream's writers; then what trains, and where (``shown``)."""
    if records is not None:
        reporting.console.message(f"data: {records.summary()}")
        if start == 0:
            reporting.output.write(0, records.metrics(), split="data")
    if stream is not None:
        stream.output = reporting.output
    reporting.console.message(f"training {model_name} for {config.steps} steps, "
                              f"{config.steps_per_call} per call -> {shown}")


def _at_data_position(compiled_steps: Callable[..., CompiledSteps], programs: CompiledSteps,
                      batches: Any, start: int) -> CompiledSteps:
    """The programs with their batch source cut at the data position less the state's step
    (built again only when that moves it)."""
    moved = programs.source.from_offset(getattr(batches, "next_index", 0) - start)
    return programs if moved is programs.source else compiled_steps(source=moved)


def _start(programs: CompiledSteps, state: TrainState) -> Start:
    """Where the first call starts: ``state`` as the calls carry it."""
    return Start(state=programs.carry(state), step=int(state.step),
                 nonfinite=int(state.nonfinite_steps))


def metric_log(output: RunOutput, timing: Timing, batch_size: int, streamed: bool,
               chosen: Strategies) -> MetricLog:
    """The run's metric log: rows read from the calls, written to ``output``."""
    return MetricLog(output, timing.timer, timing.watch, batch_size, streamed=streamed,
                     writes=chosen.metric_writes(), parts=timing.parts)


def build_hooks(config: RunConfig, reporting: Reporting, log: MetricLog, watch: Stopwatch,
                checkpoints: Checkpoints, *, data: RunData, evaluator: EvalSchedule | None,
                mirror: RunMirror | None, start_nonfinite: int, preemption: Preemption,
                callbacks: list[Callback], clock: Clock, kind: RunKind,
                start_step: int = 0) -> list[Hook]:
    """The run's hooks, in the order they act at every boundary (``hooks.py``): the metric log
    first (the loop finishes it last), the kind's own (a reinforcement-learning run's rollout
    reports), the checkpoint's last."""

    def before_halt() -> None:  # the last good checkpoint commits; the files are closed
        log.finish()
        checkpoints.wait()
        checkpoints.close()

    output = log.ordered  # every later write is timed as logging
    hooks: list[Hook] = [
        log, NonFinitePolicy(config.nonfinite, output, start_nonfinite, before_halt)]
    hooks += kind.hooks(config, data, output, reporting.primary, start_step)
    if config.profile.steps and reporting.primary:
        hooks.append(ProfileWindow(config.profile.steps, reporting.run_dir,
                                   say=output.message, watch=watch))
    if evaluator is not None:
        hooks.append(EvalHook(evaluator, output, watch, config.steps, config.eval.params))
    hooks.append(preemption)
    hooks += _callback_hooks(config.steps_per_call, callbacks, output, watch)
    return hooks + _checkpoint_hooks(config, checkpoints, log, watch, batches=data.batches,
                                     mirror=mirror, clock=clock, callbacks=callbacks)


def _callback_hooks(steps_per_call: int, callbacks: list[Callback], output: OrderedOutput,
                    watch: Stopwatch) -> list[Hook]:
    """The user's callbacks as hooks; one that cuts every call is said so."""
    hooks: list[Hook] = []
    for callback in callbacks:
        hook = CallbackHook(callback, watch)
        if 0 < hook.every < steps_per_call:
            output.message(f"{type(callback).__name__} asks for a boundary every {hook.every} "
                           f"step(s): calls run {hook.every} step(s), not steps_per_call="
                           f"{steps_per_call}")
        hooks.append(hook)
    return hooks


def _checkpoint_hooks(config: RunConfig, checkpoints: Checkpoints, log: MetricLog,
                      watch: Stopwatch, *, batches: Any, mirror: RunMirror | None, clock: Clock,
                      callbacks: list[Callback]) -> list[Hook]:
    """The hooks that save, last at every boundary: a run on object storage uploads its files
    before each save, then the checkpoint hook saves by the policy on ``clock``."""
    policy = CheckpointPolicy(config.checkpoint.every, config.checkpoint.every_seconds,
                              clock=clock, check_every=config.metrics.every)
    if mirror is None:
        return [CheckpointHook(checkpoints, policy, batches, log, watch,
                               keep_best=config.checkpoint.keep_best,
                               listeners=[c.on_checkpoint for c in callbacks])]
    return [StorageHook(lambda: mirror.stopped(checkpoints.last_committed)),
            CheckpointHook(checkpoints, policy, batches, log, watch,
                           keep_best=config.checkpoint.keep_best,
                           listeners=[c.on_checkpoint for c in callbacks],
                           before_save=lambda: mirror.sync_before_save(
                               checkpoints.last_committed))]


def _check_program_memory(programs: CompiledSteps, config: RunConfig, data: Any, parts: Parts,
                          start: int, check: bool = True) -> None:
    """Compile the program of the run's usual call (K steps, or what is left from ``start``) on
    the shapes of the state and of the data's first batch, and refuse it if its buffers do not
    fit (``preflight.check_program_memory``, naming the batch size that fits) or XLA refuses
    to compile it for its memory (``preflight.compile_or_refuse``, the same): the step is
    compiled on shapes alone, before any state exists, and the first call runs that
    executable. Data that is a plain iterator cannot be looked at: its program is compiled at
    the first call, unchecked. ``check`` False: compiled (or refused by XLA) only, its memory
    left to ``_check_call_memory``."""
    k = min(config.steps_per_call, config.steps - start)
    batch = programs.source.held(k)  # None: host batches, shaped as the data's first
    if batch is None:
        if not isinstance(data, grain.MapDataset):
            return
        batch = _batch_shapes(data, parts.placement, k, config.steps_per_call > 1)
    devices, resize = _local_devices(parts), _resize(programs, config, data, parts, k)
    # a TPU's compiler refuses a program over the chip's memory as it compiles
    compiled = preflight.compile_or_refuse(
        lambda: programs.compile(k, programs.carried_shapes(), batch), devices, k, resize)
    if check:
        preflight.check_program_memory(compiled, devices, k, resize=resize)


def _check_call_memory(programs: CompiledSteps, state: TrainState, config: RunConfig,
                       data: Any, parts: Parts, start: int) -> None:
    """On an accelerator, once the state is placed: the program checked before it existed,
    checked again against the memory free now, which counts whatever else holds device memory
    (``preflight.check_program_memory`` with ``placed``). Host memory counts the blocks the
    allocator keeps for reuse as taken: no second look on CPU."""
    local = _local_devices(parts)
    k = min(config.steps_per_call, config.steps - start)
    compiled = programs.programs.get(k)
    if compiled is None or not local or local[0].platform == "cpu":
        return
    preflight.check_program_memory(compiled, local, k, placed=preflight.placed_bytes(state),
                                   resize=_resize(programs, config, data, parts, k))


def _resize(programs: CompiledSteps, config: RunConfig, data: Any, parts: Parts,
            k: int) -> preflight.Resize | None:
    """How to compile the run's call at another batch size, on host batches shaped as the
    data's first (None for batches a source holds on the device, or a plain iterator)."""
    if programs.source.held(k) is not None or not isinstance(data, grain.MapDataset):
        return None
    stacked = config.steps_per_call > 1

    def compile_at(size: int) -> jax.stages.Compiled:
        placement = sharding.batch_placement(parts.mesh, size, stacked)
        shapes = _batch_shapes(data, placement, k, stacked)
        return programs.fn.lower(programs.carried_shapes(), shapes).compile()

    split = math.prod(parts.mesh.shape[axis] for axis in BATCH_AXES)
    return preflight.Resize(parts.placement.global_size, math.lcm(split, config.accumulate),
                            compile_at)


def _local_devices(parts: Parts) -> list[Any]:
    return [d for d in parts.mesh.devices.flat if d.process_index == jax.process_index()]


def _batch_shapes(data: grain.MapDataset, placement: sharding.BatchPlacement, k: int,
                  stacked: bool) -> Any:
    """The global batches of a call of ``k`` steps, shaped as the data's first batch."""
    return jax.tree.map(lambda leaf: _global_shape(np.asarray(leaf), placement, k, stacked),
                        data[0])


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
