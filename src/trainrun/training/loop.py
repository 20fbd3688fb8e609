"""``run(config)``: the training run, and the only place that orders its side effects.

Set-up (``setup.py``) builds the mesh, state, programs, writers, checkpoints and evaluator once
and hands back what the loop runs: where it starts, its hooks, its calls and its finish.
``_train`` below is the loop: calls sized by the hooks, run back to back until a hook or a
metrics read needs the host, then every hook at that boundary; ``finish`` (``finish.py``) writes
the summary. Metrics are read one call late, so the device is not left waiting for the host.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import grain

from trainrun import rundir
from trainrun.checkpointing import init_from
from trainrun.errors import UserError
from trainrun.platform.process import configure_process
from trainrun.rundir import write_failures
from trainrun.storage.location import Location
from trainrun.training import user_code
from trainrun.training.calls import CallRunner
from trainrun.training.hooks import Boundary, HookRunner
from trainrun.training.kinds import kind_of
from trainrun.training.preemption import Preemption
from trainrun.training.run_parts import Start
from trainrun.training.setup import Asked, run_directory, setup
from trainrun.training.summary import RunSummary

if TYPE_CHECKING:
    from trainrun.checkpointing.policy import Clock
    from trainrun.config import RunConfig
    from trainrun.training.callbacks import Callback

Batch = Any


def run(config: RunConfig, run_dir: Path | str | Location | None = None, *, model: Any = None,
        data: grain.MapDataset | Iterator[Batch] | None = None, fresh: bool = False,
        allow_config_change: bool = False, allow_data_change: bool = False,
        out: TextIO | None = None,
        eval_data: grain.MapDataset | None = None,
        callbacks: Sequence[Callback] = (), clock: Clock = time.monotonic) -> RunSummary:
    """Train ``config`` and return its summary (also written to ``summary.json``).

    A run directory with a committed checkpoint resumes from its newest readable one; a run
    whose last checkpoint is at ``steps`` is finished: nothing runs, its summary is returned.
    SIGTERM or SIGINT ends the run after the current call with a checkpoint; a second one
    ends the process at once (``preemption.py``). Anything the user's code raises in the run
    (a callback, a reward, the model's functions, ``data``), ``SystemExit`` and
    ``KeyboardInterrupt`` included, is raised as ``trainrun.UserCodeFailed`` naming the
    function (the error raised its ``__cause__``), the run recorded as failed and its last
    committed checkpoint kept.

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
    config = kind_of(config).resolved(config)  # a reward model: the pad its score is read past
    # The folders' claim: checked, then locked for the run's life (released last, after a
    # failure is recorded).
    directory = run_directory(config, run_dir, fresh)
    asked = Asked(model=model, data=data, eval_data=eval_data,
                  out=sys.stdout if out is None else out,  # the stdout of now
                  allow_config_change=allow_config_change, allow_data_change=allow_data_change,
                  callbacks=list(callbacks), clock=clock,
                  process_notice=None if settings.applied() else settings.notice)
    with directory.requests(), Preemption() as preemption:  # a bucket's deadline, say
        preemption.on_abort = lambda signal_name: rundir.record_stopped(
            directory.run_dir, directory.ckpt_dir, f"aborted by a second {signal_name}")
        started = False
        try:
            # `cleanup` closes what setup opened (the checkpoint manager, letting a save in
            # flight commit) however the run ends.
            with contextlib.ExitStack() as cleanup:
                built = setup(config, directory, asked, preemption, cleanup)
                started = True
                if isinstance(built, RunSummary):  # finished already: nothing to do
                    return built
                summary = built.finish(_train(built.start, built.hooks, built.calls))
            directory.finish()  # a run on object storage: its files all uploaded
            return summary
        except BaseException as err:
            if isinstance(err, UserError) and not started:  # refused: leave the disk as found
                directory.withdraw()
            # status "failed", and why; the user's code's failure named, SystemExit included
            failure = write_failures.on_failure(err, directory, user_code.raised_by_user(
                err, preemption.handles_interrupts()))
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
                batch = calls.next_batch(k, carried)  # the next k steps' batches, placed
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
