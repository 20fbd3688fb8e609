"""The checkpoint hook: saves at the steps and times the policy names, at evaluations under
``keep_best``, at the run's end and when it stops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainrun.checkpointing.checkpoints import Checkpoints
from trainrun.checkpointing.policy import CheckpointPolicy
from trainrun.reporting.timing import Stopwatch
from trainrun.training.hooks import Boundary, Hook
from trainrun.training.metric_log import MetricLog


class CheckpointHook(Hook):
    """Saves at the boundaries the policy names, at every evaluation under ``keep_best``, at
    the run's end and when it stops. Before a save every step's metrics are read and written
    (a non-finite halt comes first; rows up to the checkpoint survive a kill right after it:
    ``output.flush()``)."""

    def __init__(self, checkpoints: Checkpoints, policy: CheckpointPolicy, batches: Any,
                 output: MetricLog, watch: Stopwatch, keep_best: str | None = None,
                 listeners: list[Callable[[Boundary], None]] | None = None,
                 before_save: Callable[[], None] | None = None):
        self.listeners = listeners or []  # told of each save once it has started
        # The run's files put where a resume reads them (a run on object storage uploads its
        # metrics), so a committed step never lacks the rows before it.
        self.before_save = before_save
        self.checkpoints = checkpoints
        self.policy = policy
        self.batches = batches
        self.output = output
        self.watch = watch
        self.best_name = keep_best.partition("/")[2] if keep_best else None

    every_boundary = False  # its steps, its clock (poll), evaluations and the end

    def steps_to_next(self, step: int) -> int | None:
        return self.policy.steps_to_next(step)

    def poll(self, step: int) -> bool:
        return self.policy.poll(step)

    def at_boundary(self, boundary: Boundary) -> None:
        best = self.best_name
        scored = best is not None and boundary.eval is not None
        if not (boundary.last or scored or self.policy.due(boundary.step)):
            return
        boundary.sync()
        self.output.flush()
        if self.before_save is not None:
            with self.watch.phase("checkpoint"):
                self.before_save()
        evals = boundary.eval if scored else None
        metrics = None if best is None or evals is None else {f"eval/{best}": evals[best]}
        with self.watch.phase("checkpoint"):
            boundary.saved = self.checkpoints.save(
                boundary.step, boundary.state(), self.batches, wait=boundary.preempted,
                metrics=metrics)
        self.policy.saved()
        boundary.commit_wait = self.checkpoints.wait
        for listener in self.listeners:
            listener(boundary)

    def saving(self) -> bool:
        """Whether a save is still being written in the background."""
        return self.checkpoints.saving()
