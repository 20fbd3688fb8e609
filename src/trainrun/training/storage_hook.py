"""A run on object storage stops at the boundary after its mirror failed: the store did not
answer past ``storage.deadline_s``, or another job took the run's lease
(``rundir/remote_run.py``). Checkpoints already committed stay; the run's line says where a
resume starts."""

from __future__ import annotations

from trainrun.rundir.remote_run import RunMirror
from trainrun.training.hooks import Boundary, Hook


class StorageHook(Hook):
    every_boundary = False  # only when ``poll`` has seen the failure, and at the end

    def __init__(self, mirror: RunMirror):
        self.mirror = mirror

    def poll(self, step: int) -> bool:
        return self.mirror.failure is not None

    def at_boundary(self, boundary: Boundary) -> None:
        if self.mirror.failure is not None:
            raise self.mirror.failure
