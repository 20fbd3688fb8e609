"""Host work done beside the calls: one thread that writes metric rows and stacks the next call's
batch while the current call computes.

A one-device CPU call runs with Python's lock released (XLA computes on its own threads while the
calling thread waits), so a second Python thread can format rows and copy batches then. On the
default MLP at K=100 that is 6.5 µs a step of rows and 1.7 of stacking, against 16 µs of step.
Jobs run in the order they were given; an error in one is raised in the loop's thread at its
next ``submit``, ``wait`` or result.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Batch = Any


class HostWorker:
    """A thread that runs jobs in order."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="trainrun-host", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], Any]) -> Future:
        self.raise_error()
        done: Future = Future()
        self.jobs.put((job, done))
        return done

    def wait(self) -> None:
        """Every job given so far has run."""
        self.jobs.join()
        self.raise_error()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _work(self) -> None:
        while True:
            item = self.jobs.get()
            try:
                if item is None:
                    return
                job, done = item
                if self.error is None:
                    try:
                        done.set_result(job())
                    except BaseException as err:  # the loop's thread raises it
                        self.error = err
                        done.set_exception(err)
                else:
                    done.cancel()
            finally:
                self.jobs.task_done()


class BatchPrefetch:
    """The next call's stacked batch, made on the worker while the current call computes.

    cursor: the run's ``BatchCursor`` (batch ``i`` is a pure function of ``i``, so a batch can be
    made ahead without moving the position a checkpoint saves: the cursor moves only in
    ``take``). A batch made for another size than the call asks for is dropped.
    """

    def __init__(self, cursor: Any, worker: HostWorker):
        self.cursor = cursor
        self.worker = worker
        self.ahead: tuple[int, int, Future] | None = None
        self.hits = 0  # batches taken that were made ahead

    def take(self, k: int) -> Batch:
        start = self.cursor.next_index
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[:2] == (start, k):
            batch = ahead[2].result()
            self.hits += 1
        else:
            batch = self.cursor.read(start, k)
        self.cursor.next_index = start + k
        return batch

    def prepare(self, k: int) -> None:
        """Start making the ``k`` batches after those already taken."""
        start = self.cursor.next_index
        self.ahead = (start, k, self.worker.submit(lambda: self.cursor.read(start, k)))
