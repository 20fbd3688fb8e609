"""``run(config)``: the training run, and the only place that orders its side effects.

    setup (setup.py): mesh, placement, state, compiled programs, writers, checkpoints, evaluator
    while steps remain and no hook stopped the run:
        k = the nearest step any hook needs a boundary at, at most K       (hooks.py)
        jitted calls of k steps on the next k batches (state donated), back to back until
            a hook or a metrics read needs the host (often one call)
        every hook at the boundary: metrics, profile, eval, preemption, callbacks, checkpoint
    summary (summary.py)

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

from trainrun import rundir, storage
from trainrun.hooks import Boundary, HookRunner
from trainrun.preemption import Preemption
from trainrun.process import configure_process
from trainrun.setup import Run, build_hooks, run_directory, setup
from trainrun.summary import RunSummary, summarize

if TYPE_CHECKING:
    from trainrun.callbacks import Callback
    from trainrun.config import RunConfig

Batch = Any


def run(config: RunConfig, run_dir: Path | str | None = None, *, model: Any = None,
        data: grain.MapDataset | Iterator[Batch] | None = None, fresh: bool = False,
        allow_config_change: bool = False, out: TextIO = sys.stdout,
        eval_data: grain.MapDataset | None = None,
        callbacks: Sequence[Callback] = ()) -> RunSummary:
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
    eval_data: the held-out split that ``eval.every`` evaluates, batch ``i`` at index ``i``;
        defaults to the one ``config.data`` holds out.
    callbacks: ``trainrun.Callback`` objects, called at every call boundary, or with
        ``every_boundary = False`` at the boundaries the run has anyway (``callbacks.py``).
    """
    settings = configure_process()  # while JAX's backend has not started; else a notice
    path = Path(run_dir) if run_dir is not None else rundir.default_run_dir(config)
    if fresh:  # `--run-dir . --fresh`: the new run goes where `.` was, not into the old one
        path = Path(os.path.abspath(path))
    # The folders' claim: checked, then locked for the run's life (released last, after a
    # failure is recorded).
    directory = run_directory(config, path, fresh)
    with Preemption() as preemption:
        preemption.on_abort = lambda: rundir.mark_failed(path, "aborted by a second interrupt")
        try:
            # `cleanup` closes what setup opened (the checkpoint manager, letting a save in
            # flight commit) however the run ends.
            with contextlib.ExitStack() as cleanup:
                wall_start = time.perf_counter()
                built = setup(config, path, directory, model, data, allow_config_change, out,
                              cleanup, eval_data)
                if isinstance(built, RunSummary):  # finished already: nothing to do
                    return built
                if not settings.applied():
                    built.console.message(settings.notice)
                hooks = HookRunner(build_hooks(built, preemption, list(callbacks)),
                                   config.steps_per_call, config.steps, built.reader(),
                                   built.state, built.params_copy)
                return _finish(built, _train(built, hooks), wall_start)
        except BaseException as err:
            failure = storage.on_failure(err, directory)  # status "failed", with the reason
            if failure is None:
                raise
            raise failure from err
        finally:
            directory.release()


def _train(run: Run, hooks: HookRunner) -> Boundary:
    """Calls until the last step or a stop; returns the last boundary."""
    step, boundary = run.start_step, None
    try:
        while boundary is None or not boundary.last:
            k = hooks.call_size(step)
            hooks.before_call(step, k)
            calls = run.calls(step, k, hooks.calls_to_boundary(step, k), hooks.poll)
            boundary = hooks.after_calls(calls)
            step = boundary.step
    finally:
        hooks.close()  # a profile trace stops, callbacks are told, however the loop ended
    return boundary


def _finish(run: Run, boundary: Boundary, wall_start: float) -> RunSummary:
    """Everything written and committed, then the summary (and the run's status)."""
    step = boundary.step
    if run.stream is not None:
        jax.effects_barrier()  # every streamed row has been written
    run.metric_log.finish()  # every row written, the writers closed
    with run.watch.phase("checkpoint"):
        run.checkpoints.wait()  # the final save is committed before the run reports done
    if boundary.preempted:
        run.checkpoints.close()
        if run.primary:
            rundir.write_status(run.run_dir, "preempted", step)
        run.console.message(f"{boundary.stop_reason} after step {step}: checkpoint saved to "
                            f"{boundary.saved}. Run the same command to resume.")
        return RunSummary(status="preempted", steps=run.config.steps, steps_done=step,
                          start_step=run.start_step, preempted_at=step,
                          checkpoint=str(boundary.saved), provenance=run.provenance)
    if boundary.stop_reason:
        run.console.message(f"stopped at step {step}: {boundary.stop_reason}")
    summary = summarize(run, boundary, time.perf_counter() - wall_start)
    run.checkpoints.close()
    if run.primary:
        rundir.write_json(run.run_dir / rundir.SUMMARY, summary.to_dict())
        rundir.write_status(run.run_dir, "finished", step)
    run.console.message(summary.text())
    return summary
