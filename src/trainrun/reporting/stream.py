"""The host end of ``metrics.stream``: rows sent from inside a running K-step call
(``program/streamed.py``) go straight to the run's writers and console."""

from __future__ import annotations

import numpy as np

from trainrun.reporting.run_output import RunOutput
from trainrun.reporting.table import Table


class MetricStream:
    """The host end: each arriving row goes straight to the run's writers and console.

    output: the run's writers; a run compiles its step (with this stream in it) before its
    files exist, and gives the stream its writers once they do, before the first call."""

    def __init__(self, output: RunOutput | None = None):
        self.output = output
        self.last_step: int | None = None
        self.received = 0

    def __call__(self, step: int, names: list[str], values: np.ndarray) -> None:
        self.last_step = step
        self.received += 1
        assert self.output is not None, "a row arrived before the run's writers were given"
        self.output.write_table(Table(step, names, values))  # the very text the loop's reads write
