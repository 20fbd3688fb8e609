"""A run on object storage stops at the boundary after its mirror failed: the store did not
answer past ``storage.deadline_s``, or another job took the run's lease
(``rundir/remote_run.py``). Checkpoints already committed stay; the run's line says where a
resume starts."""

from __future__ import annotations

from collections.abc import Callable

from trainrun.training.hooks import Boundary, Hook


class StorageHook(Hook):
    every_boundary = False  # only when ``poll`` has seen the failure, and at the end

    def __init__(self, stopped: Callable[[], Exception | None]):
        self.stopped = stopped  # ``RunMirror.stopped`` at the last committed step

    def poll(self, step: int) -> bool:
        return self.stopped() is not None

    def at_boundary(self, boundary: Boundary) -> None:
        failure = self.stopped()
        if failure is not None:
            raise failure
