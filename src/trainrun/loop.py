"""``run(config)``: the training run, and the only place that orders its side effects.

    build state ─► loop: next K batches ─► one jitted call (state donated)
                         ─► read the *previous* call's metrics ─► write, log
    ─► summary

Reading metrics one call late keeps the device busy: the host blocks on call ``i`` only after
call ``i+1`` is queued behind it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import grain
import jax
import numpy as np

from trainrun import distributed, mfu, preflight, rundir, sharding, storage
from trainrun.checkpoint import Checkpoints, checkpoint_dir
from trainrun.config import RunConfig
from trainrun.console import Console, make_console
from trainrun.data import batch_iterator, build_dataset, build_eval_dataset
from trainrun.dispatch import CompiledSteps, MetricsReader, PendingCall, stack_batches
from trainrun.errors import UserError
from trainrun.evaluation import Evaluator, eval_line
from trainrun.models import Model, build_model
from trainrun.optim import Optimizer, build_optimizer
from trainrun.precision import Policy, policy_from_config
from trainrun.preemption import Preemption
from trainrun.process import configure_process
from trainrun.profiling import ProfileWindow
from trainrun.resume import check_config, provenance_changes, schedule_shift
from trainrun.state import TrainState, create_state
from trainrun.stream import MetricStream
from trainrun.timing import StepTimer, Stopwatch, provenance, run_summary, summary_text
from trainrun.writers import RunOutput, Table, build_output

Batch = Any


def root_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init key, base step key) from the run's seed.

    The init key is ``jax.random.key(seed)`` itself, as a hand-written loop would use it; the
    step key is folded off it so that init and per-step draws never share a stream.
    """
    root = jax.random.key(seed)
    return root, jax.random.fold_in(root, 0x7374)  # "st"


# Init runs once, so it is compiled without XLA's algebraic simplifier: that pass would fold a
# user's `normal(k, shape) * 0.1` into the sampler's own sqrt(2) factor and round differently
# from the same function run op by op. Without it, a jitted (and sharded) init gives the very
# bits a hand-written eager `init(key)` gives.
INIT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "algsimp"}


class NonFiniteError(UserError):
    """A non-finite loss or gradient under ``nonfinite: halt``; names the step."""


def _state_builder(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None):
    policy = policy or Policy()

    def build() -> TrainState:
        init_key, base_key = root_keys(seed)  # traced: the same bits as eager, on every process
        return create_state(policy.cast_to_param(model.init(init_key)), optimizer.tx, base_key,
                            policy.initial_loss_scale())

    return build


def abstract_state(model: Model, optimizer: Optimizer, seed: int,
                   policy: Policy | None = None) -> TrainState:
    """The state's shapes and dtypes, computed without allocating it."""
    return jax.eval_shape(_state_builder(model, optimizer, seed, policy))


def init_state(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None = None,
               shardings: TrainState | None = None) -> TrainState:
    """A fresh state, created where ``shardings`` puts it: each device computes only its own
    shards, so a model never has to fit whole on one device."""
    build = jax.jit(_state_builder(model, optimizer, seed, policy), out_shardings=shardings)
    return build.lower().compile(compiler_options=INIT_COMPILER_OPTIONS)()


def run(config: RunConfig, run_dir: Path | str | None = None, *, model: Model | None = None,
        data: grain.MapDataset | Iterator[Batch] | None = None, fresh: bool = False,
        allow_config_change: bool = False, out: TextIO = sys.stdout,
        eval_data: grain.MapDataset | None = None) -> dict[str, Any]:
    """Train ``config`` and return its summary (also written to ``summary.json``).

    A run directory with a committed checkpoint resumes from its newest readable one; a run
    whose last checkpoint is at ``steps`` is finished: nothing runs, its summary is returned.
    SIGTERM or SIGINT ends the run after the current call with a checkpoint.

    model: defaults to the one ``config.model`` names.
    data: a Grain ``MapDataset`` of batches (checkpointable position) or any iterator of host
        NumPy batches; defaults to the one ``config.data`` names. With several processes, each
        process's ``data`` yields its own rows of each global batch.
    fresh: move an existing run (and its checkpoints) aside and start over.
    allow_config_change: resume even though config keys that alter the trajectory changed.
    eval_data: the held-out split that ``eval.every`` evaluates, batch ``i`` at index ``i``;
        defaults to the one ``config.data`` holds out.
    """
    configure_process()  # trainrun's process settings, while JAX's backend has not started
    path = Path(run_dir) if run_dir is not None else rundir.default_run_dir(config)
    if fresh:  # `--run-dir . --fresh`: the new run goes where `.` was, not into the old one
        path = Path(os.path.abspath(path))
    # The folders' claim: checked, then locked for the run's life (released last, after a
    # failure is recorded).
    directory = rundir.RunDirectory(path, checkpoint_dir(config, path), fresh)
    with Preemption() as preemption:
        preemption.on_abort = lambda: rundir.mark_failed(path, "aborted by a second interrupt")
        try:
            # `cleanup` closes what _run opened (the checkpoint manager, letting a save in
            # flight commit) however it ends.
            with contextlib.ExitStack() as cleanup:
                return _run(config, path, model, data, allow_config_change, out,
                            preemption, cleanup, eval_data, directory)
        except BaseException as err:
            failure = storage.on_failure(err, directory)  # status "failed", with the reason
            if failure is None:
                raise
            raise failure from err
        finally:
            directory.release()


def _run(config: RunConfig, run_dir: Path, model: Model | None, data: Any,
         allow_config_change: bool, out: TextIO,
         preemption: Preemption, cleanup: contextlib.ExitStack,
         eval_data: grain.MapDataset | None, directory: rundir.RunDirectory) -> dict[str, Any]:
    wall_start = time.perf_counter()
    distributed.initialize(config.distributed)  # before anything asks JAX for devices
    primary = jax.process_index() == 0  # only process 0 writes files and logs
    prov = provenance(config.digest())
    ckpt_dir = directory.ckpt_dir
    if primary:  # a folder that is not trainrun's, or is in use, is refused; nothing written
        directory.check()
    batch_size = _batch_size(config, data)
    unit, per_step = _throughput_unit(config, batch_size)
    console = make_console(config.steps, per_step,
                           out if primary else open(os.devnull, "w"), unit)  # noqa: SIM115
    latest = (rundir.committed_steps(ckpt_dir) or [None])[-1]
    if latest is not None and latest >= config.steps and not directory.fresh:
        console.message(rundir.finished_message(run_dir, latest, config.steps))
        return rundir.read_summary(run_dir)
    # Every input is checked (mesh, model, data) before anything is created.
    mesh = sharding.build_mesh(config.mesh)
    placement = sharding.batch_placement(mesh, batch_size, stacked=config.steps_per_call > 1)

    counted = None if model else config.model  # a model passed in has no analytic FLOP count
    model = model or build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    policy = policy_from_config(config.precision)
    abstract = abstract_state(model, optimizer, config.seed, policy)
    state_sharding = sharding.state_shardings(mesh, abstract, model.logical_axes, optimizer.tx,
                                              config.mesh)
    if data is None:
        data = build_dataset(config.data, seed=config.seed, process_index=placement.rows[0],
                             process_count=placement.rows[1])
    preflight.check_batch(model, data, abstract.params, from_config=counted is not None)
    batches = (batch_iterator(data, getattr(config.data, "prefetch_threads", 0))
               if isinstance(data, grain.MapDataset) else iter(data))
    evaluator = _evaluator(config, model, policy, mesh, eval_data, state_sharding.params)
    if primary:  # creates, locks and marks the folders (moves an old run aside: --fresh)
        for notice in directory.claim():
            console.message(notice)
    checkpoints = cleanup.enter_context(Checkpoints(ckpt_dir, config, prov))
    watch = Stopwatch()
    with watch.phase("init"):
        state = _restore_or_init(
            checkpoints, config, prov, run_dir, model, optimizer, policy, abstract,
            state_sharding, batches, allow_config_change, console, primary)
    output = build_output(
        run_dir, console, log_every=config.log_every, total_steps=config.steps,
        primary=primary, start_step=int(state.step), tensorboard=config.metrics.tensorboard,
        wandb=config.metrics.wandb, wandb_project=config.metrics.wandb_project,
        config=config.to_dict(), name=config.name)
    if primary:
        rundir.write_status(run_dir, "running", int(state.step))
    stream = MetricStream(output) if config.metrics.stream else None
    programs = CompiledSteps(model, optimizer, config.steps_per_call, watch, abstract=abstract,
                             accumulate=config.accumulate, policy=policy,
                             state_sharding=state_sharding, batch_sharding=placement.sharding,
                             stream=stream)
    profile = ProfileWindow(config.profile.steps, run_dir, enabled=primary)
    timer = StepTimer()
    console.message(f"training {model.name} for {config.steps} steps, "
                    f"{config.steps_per_call} per call -> {run_dir}")

    reader: MetricsReader | None = None
    last_metrics: dict[str, float] = {}
    nonfinite_seen = int(state.nonfinite_steps)

    def write(table: Table | None) -> None:
        """A read window's rows to the writers and console (streamed rows went already)."""
        nonlocal last_metrics, nonfinite_seen
        if table is None:
            return
        log_start = time.perf_counter()
        if stream is None:
            output.write_table(table)
        output.write_window(table.last, len(table.values), timer.per_step_s[-1], batch_size)
        counts = table.values[:, table.names.index("nonfinite_steps")]
        for i in np.flatnonzero(np.diff(counts, prepend=nonfinite_seen) > 0):  # skipped steps
            nonfinite_seen = int(counts[i])
            _on_nonfinite(config, table.first + int(i), table.row(i), output, checkpoints)
        last_metrics = table.row(len(table.values) - 1)
        watch.add("log", time.perf_counter() - log_start)

    done = int(state.step)
    carried = programs.carry(state)  # the state as the calls take and donate it
    del state
    data_wait = 0.0
    stop = False
    profiling = bool(config.profile.steps) and primary
    watch.start_loop()  # the training loop's own time; its phases are taken out of it
    while done < config.steps:
        # Calls end on checkpoint steps, so the state saved is the state at that step.
        k = min(config.steps_per_call, checkpoints.until_next(done, config.steps))
        if evaluator is not None:  # and on eval steps, so eval sees the params of that step
            k = min(k, evaluator.steps_to_next(done, config.steps))
        data_start = time.perf_counter()
        if config.steps_per_call == 1:
            batch = next(batches)
        else:
            batch = stack_batches([next(batches) for _ in range(k)])
        batch = placement.put(batch)
        data_wait += time.perf_counter() - data_start
        if k not in programs.programs:  # compile time stays out of the step-time windows
            programs.compile(k, carried, batch)
            output.reset_rate(done)
        if profiling:
            profile.before_call(done, k)
        dispatched_at = time.perf_counter()
        carried, packed = programs(k, carried, batch)
        if reader is None:
            reader = MetricsReader(programs.metric_names, timer, config.log_every)
        # One call late: the calls before this one are read while this one runs.
        if reader.due():
            write(reader.read())
        reader.add(PendingCall(done, k, packed, dispatched_at))
        done += k
        if profiling:
            with watch.phase("profile"):
                message = profile.after_call(done, carried)
            if message:
                output.message(message)
        if evaluator is not None and evaluator.due(done, config.steps):
            write(reader.read())  # train rows first: the file stays in step order
            with watch.phase("eval"):
                # before the next call donates the state
                results = evaluator(programs.state(carried).params)
            output.write(done, results, "eval")
            output.message(eval_line(done, config.steps, results))
        stop = preemption.requested(done) and done < config.steps  # at the end: just finish
        if stop or checkpoints.due(done, config.steps):
            write(reader.read())
            output.flush()  # the metrics up to a checkpoint survive a kill right after it
            with watch.phase("checkpoint"):
                saved = checkpoints.save(done, programs.state(carried), batches, wait=stop)
            if stop:
                break
    if reader is not None:
        write(reader.read())
    profile.close()
    watch.add("data", data_wait)
    watch.end_loop()
    if stream is not None:
        jax.effects_barrier()  # every streamed row has been written
    output.close()
    with watch.phase("checkpoint"):
        checkpoints.wait()  # the final save is committed before the run reports done
    checkpoints.close()
    if stop:
        if primary:
            rundir.write_status(run_dir, "preempted", done)
        console.message(f"preempted ({preemption.reason}) after step {done}: checkpoint saved "
                        f"to {saved}. Run the same command to resume.")
        return {"preempted_at": done, "checkpoint": str(saved), "provenance": prov}

    flops, source = mfu.flops_per_step(programs.programs, programs.one_step, abstract, batch,
                                       counted, batch_size)
    peak, why = mfu.find_peak(jax.default_backend(), jax.devices()[0].device_kind,
                              jax.device_count(), config.precision.compute)
    summary = run_summary(config, last_metrics, timer, watch, prov, batch_size,
                       time.perf_counter() - wall_start)
    summary.update(mfu.utilization(flops, summary["step_time_median_s"], peak, why, source))
    if primary:
        rundir.write_json(run_dir / rundir.SUMMARY, summary)
        rundir.write_status(run_dir, "finished", done)
    console.message(summary_text(summary))
    return summary


def _evaluator(config: RunConfig, model: Model, policy: Policy, mesh: Any,
               eval_data: grain.MapDataset | None,
               params_sharding: Any) -> Evaluator | None:
    """The eval hook (None when ``eval.every`` is 0): its batches are this process's rows of
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
                     shardings=(params_sharding, placement.sharding))


def _restore_or_init(checkpoints: Checkpoints, config: RunConfig, prov: dict[str, Any],
                     run_dir: Path, model: Model, optimizer: Optimizer, policy: Policy,
                     abstract: TrainState, state_sharding: TrainState, batches: Any,
                     allow_config_change: bool, console: Console, primary: bool) -> TrainState:
    """The newest readable checkpoint's state, placed by ``state_sharding`` (any mesh), with the
    data iterator set to its position; else a fresh state. Then the run's files are written
    for the step it starts at (nothing is written before a refusal)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, state_sharding)
    changes: list[str] = []
    restored = checkpoints.restore(target, batches, lambda meta: changes.extend(
        check_config(meta["config"], config, allow_config_change, run_dir)))
    step = restored.step if restored is not None else 0
    if primary:
        rundir.start(run_dir, config, prov, step)
    for name in checkpoints.partial:
        console.message(f"removing {name}: a checkpoint whose save never finished")
    if restored is None:
        return jax.block_until_ready(
            init_state(model, optimizer, config.seed, policy, state_sharding))
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
    return restored.state


def _on_nonfinite(config: RunConfig, step: int, metrics: dict[str, float], output: RunOutput,
                  checkpoints: Checkpoints) -> None:
    """The ``nonfinite`` policy. The step already kept params and optimizer state as they were;
    ``halt`` stops the run here, before anything after this step can be saved. A save still in
    flight is of an earlier step (saves follow a read of every step before them): it is let
    finish, so the last good checkpoint is committed, not cut off by the exit."""
    if config.nonfinite == "halt":
        output.close()
        checkpoints.wait()
        checkpoints.close()
        raise NonFiniteError(
            f"step {step}: loss or gradients are not finite (loss={metrics['loss']}); the run "
            f"halted (nonfinite=halt) with the update not applied and no checkpoint written "
            f"after it. Lower optimizer.lr, set optimizer.clip_norm, check the data, or pass "
            f"nonfinite=skip to skip such steps")
    scale = f"; loss scale was {metrics['loss_scale']:g}" if "loss_scale" in metrics else ""
    output.message(f"step {step}: loss or gradients not finite; update skipped "
                    f"({int(metrics['nonfinite_steps'])} so far{scale})")


def _batch_size(config: RunConfig, data: Any) -> int:
    return getattr(data, "batch_size", None) or config.data.batch_size


def _throughput_unit(config: RunConfig, batch_size: int) -> tuple[str, int]:
    """What the console counts per second: tokens for sequence data, else examples."""
    seq_len = getattr(config.data, "seq_len", None)
    return ("tokens", batch_size * seq_len) if seq_len else ("examples", batch_size)
