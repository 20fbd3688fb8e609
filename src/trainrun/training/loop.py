"""``run(config)``: the training run, and the only place that orders its side effects.

Set-up (``setup.py``) builds the mesh, state, programs, writers, checkpoints and evaluator once;
``_train`` below is the loop: calls sized by the hooks, run back to back until a hook or a
metrics read needs the host, then every hook at that boundary; ``_finish`` writes the summary.
Metrics are read one call late, so the device is not left waiting for the host.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import grain
import jax

from trainrun import rundir
from trainrun.checkpointing import init_from
from trainrun.errors import UserError
from trainrun.platform.process import configure_process
from trainrun.rundir import location, storage
from trainrun.training.calls import CallRunner
from trainrun.training.hooks import Boundary, HookRunner
from trainrun.training.metric_log import MetricLog
from trainrun.training.metrics_reader import MetricsReader
from trainrun.training.preemption import Preemption
from trainrun.training.setup import (
    Reporting,
    Start,
    Timing,
    build_hooks,
    metric_log,
    params_copier,
    run_directory,
    setup,
)
from trainrun.training.summary import RunSummary, summarize

if TYPE_CHECKING:
    from trainrun.checkpointing.checkpoints import Checkpoints
    from trainrun.checkpointing.policy import Clock
    from trainrun.config import RunConfig
    from trainrun.program.compiled import CompiledSteps
    from trainrun.training.callbacks import Callback

Batch = Any


def run(config: RunConfig, run_dir: Path | str | None = None, *, model: Any = None,
        data: grain.MapDataset | Iterator[Batch] | None = None, fresh: bool = False,
        allow_config_change: bool = False, allow_data_change: bool = False,
        out: TextIO = sys.stdout,
        eval_data: grain.MapDataset | None = None,
        callbacks: Sequence[Callback] = (), clock: Clock = time.monotonic) -> RunSummary:
    """Train ``config`` and return its summary (also written to ``summary.json``).

    A run directory with a committed checkpoint resumes from its newest readable one; a run
    whose last checkpoint is at ``steps`` is finished: nothing runs, its summary is returned.
    SIGTERM or SIGINT ends the run after the current call with a checkpoint.

    model: a ``trainrun.Model``; defaults to the one ``config.model`` names.
    data: a Grain ``MapDataset`` of batches (checkpointable position) or any iterator of host
        NumPy batches; defaults to the one ``config.data`` names. With several processes, each
        process's ``data`` yields its own rows of each global batch.
    fresh: move an existing run (and its checkpoints) aside and start over.
    allow_config_change: resume even though config keys that alter the trajectory changed.
    allow_data_change: resume even though a data file the run reads differs from the one it
        trained on (its content fingerprint in the run's ``data_files.json``).
    eval_data: the held-out split that ``eval.every`` evaluates, batch ``i`` at index ``i``;
        defaults to the one ``config.data`` holds out.
    callbacks: ``trainrun.Callback`` objects, called at every call boundary, or with
        ``every_boundary = False`` at the boundaries the run has anyway (``callbacks.py``).
    clock: monotonic seconds, read for what the run decides by time (a checkpoint every
        ``checkpoint.every_seconds``); a test passes a clock of its own.
    """
    settings = configure_process()  # while JAX's backend has not started; else a notice
    config = init_from.resolved(config)  # a Hugging Face source's config.json: the model
    if run_dir is not None and location.is_remote(run_dir):  # written through a local stage
        directory = run_directory(config, run_dir, fresh)
        path = directory.run_dir
    else:
        path = Path(run_dir) if run_dir is not None else rundir.default_run_dir(config)
        if fresh:  # `--run-dir . --fresh`: the new run goes where `.` was, not into the old one
            path = Path(os.path.abspath(path))
        # The folders' claim: checked, then locked for the run's life (released last, after a
        # failure is recorded).
        directory = run_directory(config, path, fresh)
    with Preemption() as preemption:
        preemption.on_abort = lambda: rundir.mark_failed(path, "aborted by a second interrupt",
                                                         directory.ckpt_dir)
        started = False
        try:
            # `cleanup` closes what setup opened (the checkpoint manager, letting a save in
            # flight commit) however the run ends.
            with contextlib.ExitStack() as cleanup:
                wall_start = time.perf_counter()
                built = setup(config, path, directory, model=model, data=data,
                              eval_data=eval_data, allow_config_change=allow_config_change,
                              allow_data_change=allow_data_change,
                              out=out, cleanup=cleanup)
                started = True
                if isinstance(built, RunSummary):  # finished already: nothing to do
                    return built
                if not settings.applied():
                    built.reporting.console.message(settings.notice)
                log = metric_log(built.reporting.output, built.timing, built.batch_size,
                                 built.stream is not None, built.strategies)
                hooks = HookRunner(
                    build_hooks(config, built.reporting, log, built.timing.watch,
                                built.checkpoints, batches=built.batches,
                                evaluator=built.evaluator, mirror=built.mirror,
                                start_nonfinite=built.start.nonfinite, preemption=preemption,
                                callbacks=list(callbacks), clock=clock),
                    config.steps_per_call, config.steps,
                    MetricsReader(built.programs, built.timing.timer, config.metrics.every),
                    built.programs.state, params_copier(built.programs))
                calls = CallRunner(built.programs, built.batches, built.parts.placement,
                                   built.timing, stacked=config.steps_per_call > 1,
                                   saving=built.checkpoints.saving,
                                   reset_rate=built.reporting.output.reset_rate)
                boundary = _train(built.start, hooks, calls)
                summary = _finish(boundary, log, calls, wall_start, config=config,
                                  reporting=built.reporting, timing=built.timing,
                                  checkpoints=built.checkpoints, programs=built.programs,
                                  counted=built.parts.counted, batch_size=built.batch_size,
                                  start_step=built.start.step,
                                  streamed=built.stream is not None)
            directory.finish()  # a run on object storage: its files all uploaded
            return summary
        except BaseException as err:
            if isinstance(err, UserError) and not started:  # refused: leave the disk as found
                directory.withdraw()
            failure = storage.on_failure(err, directory)  # status "failed", with the reason
            if failure is None:
                raise
            raise failure from err
        finally:
            directory.release()


def _train(start: Start, hooks: HookRunner, calls: CallRunner) -> Boundary:
    """The loop: calls until the last step or a stop; returns the last boundary."""
    step, carried, boundary = start.step, start.state, None
    try:
        while boundary is None or not boundary.last:
            k = hooks.call_size(step)  # K, or fewer to end at a step a hook needs
            hooks.before_call(step, k)
            pending = []
            for _ in range(hooks.calls_to_boundary(step, k)):
                batch = calls.next_batch(k)  # the next k steps' batches, on the devices
                carried, call = calls.call(step, k, carried, batch)  # the state donated
                pending.append(call)  # its metrics, read one call late
                step += k
                if hooks.poll(step):  # a signal or a clock needs the host now
                    break
            # metrics handed on, then every hook in order: eval, preemption, checkpoint
            boundary = hooks.after_calls(pending, carried)
            step = boundary.step
    finally:
        hooks.close()  # a profile trace stops, callbacks are told, however the loop ended
    return boundary


def _finish(boundary: Boundary, log: MetricLog, calls: CallRunner, wall_start: float, *,
            config: RunConfig, reporting: Reporting, timing: Timing, checkpoints: Checkpoints,
            programs: CompiledSteps, counted: Any, batch_size: int, start_step: int,
            streamed: bool) -> RunSummary:
    """Everything written and committed, then the summary (and the run's status)."""
    step = boundary.step
    if streamed:
        jax.effects_barrier()  # every streamed row has been written
    log.finish()  # every row written, the writers closed
    with timing.watch.phase("checkpoint"):
        checkpoints.wait()  # the final save is committed before the run reports done
    if boundary.preempted:
        checkpoints.close()
        return _preempted(boundary, reporting, config.steps, start_step)
    if boundary.stop_reason:
        reporting.console.message(f"stopped at step {step}: {boundary.stop_reason}")
    flops = programs.flops_per_step(calls.example, counted, batch_size)
    summary = summarize(config, boundary, time.perf_counter() - wall_start, flops=flops,
                        timer=timing.timer, watch=timing.watch, batch_size=batch_size,
                        start_step=start_step, final_metrics=log.last,
                        best_checkpoint=checkpoints.best(), provenance=reporting.provenance)
    checkpoints.close()
    if reporting.primary:
        rundir.write_json(reporting.run_dir / rundir.SUMMARY, summary.to_dict())
        rundir.write_status(reporting.run_dir, "finished", step)
    reporting.console.message(summary.text())
    return summary


def _preempted(boundary: Boundary, reporting: Reporting, steps: int,
               start_step: int) -> RunSummary:
    """A stopped run's summary, its status "preempted": the same command resumes it."""
    step = boundary.step
    if reporting.primary:
        rundir.write_status(reporting.run_dir, "preempted", step)
    reporting.console.message(f"{boundary.stop_reason} after step {step}: checkpoint saved to "
                              f"{boundary.saved}. Run the same command to resume.")
    return RunSummary(status="preempted", steps=steps, steps_done=step, start_step=start_step,
                      preempted_at=step, checkpoint=str(boundary.saved),
                      provenance=reporting.provenance)
