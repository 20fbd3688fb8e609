"""Metric rows written by one thread beside the loop (``writer_thread``): the ``Writes`` the
metric log (``training/metric_log.py``) takes in place of writing in the loop's thread.

Jobs run in order while the loop goes on with the next calls; a failed job is raised in the
loop's thread at the next hand-over or wait. With calls run in the calling thread the second
core is free (docs/internals.md, "Fast paths").
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class WriterThread:
    """Runs each job handed over on one thread, in the order handed."""

    def __init__(self) -> None:
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="trainrun-metrics")
        self.pending: collections.deque[Future[None]] = collections.deque()

    def submit(self, job: Callable[[], None]) -> None:
        """``job`` queued after every job before it; raises the failure of one that finished."""
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()
        self.pending.append(self.writer.submit(job))

    def wait(self) -> None:
        """Every job handed over done; raises the first that failed."""
        while self.pending:
            self.pending.popleft().result()

    def close(self) -> None:
        """The jobs handed over run to their end and the thread stops; raises nothing."""
        self.writer.shutdown(wait=True)
