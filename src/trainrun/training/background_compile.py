"""A program compiled in a thread of its own while set-up goes on.

XLA compiles without holding Python's lock, so a fresh run's init program compiles here while
set-up compiles the step program in the calling thread (to check that program's memory before any
state exists): the time to the first step holds the longer of the two compiles, not their sum
(docs/internals.md, "Time to the first step"). Tracing and lowering, which are Python, stay in
the calling thread; only XLA's compile moves.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import jax


class BackgroundCompile:
    """``compile(lowered)`` started in a thread at construction; ``result`` waits for it."""

    def __init__(self, lowered: jax.stages.Lowered,
                 compile: Callable[[jax.stages.Lowered], jax.stages.Compiled]):
        # one worker, shut down at once: the thread ends with the compile, and Python's exit
        # waits for it rather than leave XLA compiling while the process is torn down
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainrun-compile")
        self._future = pool.submit(compile, lowered)
        pool.shutdown(wait=False)

    def result(self) -> jax.stages.Compiled:
        """The compiled program, once compiled; the compile's error, raised here."""
        return self._future.result()

    def wait(self) -> None:
        """Wait for the compile to end, however it ends (a run refused meanwhile returns after
        it: no compile outlives the run that started it)."""
        concurrent.futures.wait([self._future])
