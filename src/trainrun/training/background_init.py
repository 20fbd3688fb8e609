"""A fresh run's init made ready in a thread of its own while set-up goes on.

XLA compiles without holding Python's lock, so while set-up compiles the step program in the
calling thread (to check that program's memory before the run's files are claimed), a fresh
run's init is readied here: its program compiled (the plain path), or, on a TPU with one
device, its state built op by op (``tpu_op_by_op_init``). The time to the first step holds the
longer of the two, not their sum (docs/internals.md, "Time to the first step"). Tracing and
lowering the init program, which are Python, stay in the calling thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from trainrun.program.state import TrainState

StateMaker = Callable[[], TrainState]  # a compiled init program, or the state built already


class BackgroundInit:
    """``ready()`` started in a thread at construction; ``result`` waits for its state maker."""

    def __init__(self, ready: Callable[[], StateMaker]):
        # one worker, shut down at once: the thread ends with the work, and Python's exit
        # waits for it rather than leave XLA compiling while the process is torn down
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainrun-init")
        self._future = pool.submit(ready)
        pool.shutdown(wait=False)

    def result(self) -> StateMaker:
        """What makes the state, once ready; the work's error, raised here."""
        return self._future.result()

    def wait(self) -> None:
        """Wait for the work to end, however it ends (a run refused meanwhile returns after
        it: no compile outlives the run that started it)."""
        concurrent.futures.wait([self._future])
