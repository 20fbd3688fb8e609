"""The ``nonfinite`` policy, as a hook on every table of metrics the run reads.

A step whose loss, gradients or update is not finite was already not applied by the step itself
(params and optimizer state kept, counted in ``nonfinite_steps``; ``step.py``). Here the run
decides what follows: ``skip`` says so and goes on; ``halt`` stops the run at that step, before
anything after it can be saved (checkpoints read every step's metrics first), with the last good
checkpoint committed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trainrun.errors import UserError
from trainrun.reporting.table import Table
from trainrun.training.hooks import Hook
from trainrun.training.metric_log import OrderedOutput


class NonFiniteError(UserError):
    """A non-finite loss or gradient under ``nonfinite: halt``; names the step."""


class NonFinitePolicy(Hook):
    """policy: ``skip`` or ``halt``. seen: the state's ``nonfinite_steps`` when the run (re)started.
    before_halt: lets a save in flight commit and closes the writers before the error."""

    def __init__(self, policy: str, output: OrderedOutput, seen: int,
                 before_halt: Callable[[], None]):
        self.policy = policy
        self.output = output
        self.seen = seen
        self.before_halt = before_halt

    def on_table(self, table: Table) -> None:
        counts = table.values[:, table.names.index("nonfinite_steps")]
        for i in np.flatnonzero(np.diff(counts, prepend=self.seen) > 0):  # skipped steps
            self.seen = int(counts[i])
            self._skipped(table.first + int(i), table.row(int(i)))

    def _skipped(self, step: int, metrics: dict[str, float]) -> None:
        if self.policy == "halt":
            self.before_halt()
            raise NonFiniteError(
                f"step {step}: loss or gradients are not finite (loss={metrics['loss']}); the "
                f"run halted (nonfinite=halt) with the update not applied and no checkpoint "
                f"written after it. Lower optimizer.lr, set optimizer.clip_norm, check the "
                f"data, or pass nonfinite=skip to skip such steps")
        scale = f"; loss scale was {metrics['loss_scale']:g}" if "loss_scale" in metrics else ""
        self.output.message(f"step {step}: loss or gradients not finite; update skipped "
                            f"({int(metrics['nonfinite_steps'])} so far{scale})")
