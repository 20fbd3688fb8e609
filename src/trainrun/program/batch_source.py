"""Where a call's steps find their batches: ``BatchSource``, and the plain source,
``HostBatches``: the host's batches, placed on the mesh and passed into each call (stacked
``[k, ...]`` when calls run K > 1). Another source may hold its batches where the calls cut
them themselves (``fast/resident.py``: on the device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from trainrun.data import BatchCursor, stack_batches
from trainrun.program.sharding import BatchPlacement
from trainrun.program.state import TrainState
from trainrun.program.step import make_multi_step

Batch = Any
RowStep = Callable[[TrainState, Batch], tuple[TrainState, jax.Array]]
Body = Any  # (state, what the calls take) -> (state, rows)


class BatchSource(Protocol):
    """What the step programs and the loop ask of where the batches come from."""

    def rows_program(self, one_row: RowStep, scanned: bool) -> Body:
        """``one_row`` once, or K times under a scan, on what the calls take."""
        ...

    def placed(self, batch_sharding: jax.sharding.NamedSharding,
               replicated: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
        """How what the calls take is placed on the mesh."""
        ...

    def counted(self, programs: dict[int, Any], example: Batch) -> tuple[dict[int, Any], Batch]:
        """The compiled programs whose FLOPs count a step, and a host batch the step takes
        (``flops.flops_per_step``); ``example``: what the last call took."""
        ...

    def held(self, k: int) -> Any:
        """What the call of ``k`` steps takes when this source holds it; None: host batches."""
        ...

    def take(self, batches: Any, k: int, placement: BatchPlacement, stacked: bool) -> Any:
        """What the call of the next ``k`` steps takes, ``batches`` (the host iterator) moved
        ``k`` batches on."""
        ...

    def from_offset(self, offset: int) -> BatchSource:
        """The source of a run whose data position is ``offset`` batches ahead of its step
        (itself when that changes nothing)."""
        ...


class HostBatches:
    """The host's batches, placed on the mesh by ``placement`` and passed into each call."""

    def rows_program(self, one_row: RowStep, scanned: bool) -> Body:
        return make_multi_step(one_row) if scanned else one_row

    def placed(self, batch_sharding: jax.sharding.NamedSharding,
               replicated: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
        return batch_sharding

    def counted(self, programs: dict[int, Any], example: Batch) -> tuple[dict[int, Any], Batch]:
        return programs, example

    def held(self, k: int) -> None:
        return None

    def take(self, batches: Any, k: int, placement: BatchPlacement, stacked: bool) -> Any:
        if not stacked:
            batch = next(batches)
        elif isinstance(batches, BatchCursor):  # k batches in one gather
            batch = batches.take(k)
        else:
            batch = stack_batches([next(batches) for _ in range(k)])
        return placement.put(batch)

    def from_offset(self, offset: int) -> HostBatches:
        return self
