"""Batches gathered on the device (``resident_batches``): a small in-memory dataset placed there
once, each step's batch cut from it inside the jitted call, so no host array crosses into a
call. ``ResidentBatches`` is the ``BatchSource`` (``program/batch_source.py``) the step
programs and the loop take in place of the host's batches.

Only for an ``ArrayBatches`` of plain arrays read in order (``shuffle: false``), on one device
and one process, up to ``RESIDENT_MAX_BYTES``: step ``s`` reads global batch ``s + offset``
(the data position minus the state's step, fixed for a run), its rows exactly those
``ArrayBatches.__getitem__`` gives; the cursor still moves ``k`` batches a call, so a
checkpoint's data position is the same as without. Shuffled data stays on the host: its
gathered rows made XLA round some steps differently from the host path, on which every bitwise
promise is made (docs/internals.md, "Fast paths").
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.data.pipeline import ArrayBatches, BatchCursor
from trainrun.program.batch_source import Body, RowStep
from trainrun.program.sharding import BatchPlacement
from trainrun.program.state import TrainState

Batch = dict[str, jax.Array]

RESIDENT_MAX_BYTES = 1 << 28  # the dataset's arrays on the device; larger ones stay on the host


class ResidentBatches:
    """``dataset``'s arrays on the device, and how a call's batches are cut from them.

    The calls take ``args(k)``: the arrays and a length-``k`` vector that gives the call its
    length. Inside, each step gathers its own batch from the state's step counter, not the
    call's K batches at its start: one gather that large is split across XLA:CPU's thread
    pool."""

    def __init__(self, dataset: ArrayBatches, offset: int):
        self.dataset = dataset
        self.offset = offset
        self.arrays = {name: jax.device_put(np.ascontiguousarray(array))
                       for name, array in dataset.arrays.items()}
        self._lengths: dict[int, jax.Array] = {}

    def args(self, k: int) -> tuple[Batch, jax.Array]:
        """What a call of ``k`` steps takes: device arrays made once and reused, so no host
        array crosses into the call."""
        if k not in self._lengths:  # placed explicitly: the calls take no host array at all
            self._lengths[k] = jax.device_put(np.zeros(k, np.int32))
        return self.arrays, self._lengths[k]

    def batch(self, step: jax.Array, args: tuple[Batch, jax.Array]) -> Batch:
        """The batch of the step after ``step`` (traced), as the host path feeds it."""
        arrays, _ = args
        data = self.dataset
        start = (((step + self.offset) % data.batches_per_epoch) * data.batch_size
                 + data.rows.start)
        rows = start + jnp.arange(data.rows.stop - data.rows.start, dtype=jnp.int32)
        batch = {name: jnp.take(array, rows, axis=0) for name, array in arrays.items()}
        # A buffer of its own, as a host batch arrives, before any step reads it.
        return jax.lax.optimization_barrier(batch)

    def example(self, k: int) -> dict[str, np.ndarray]:
        """A host batch shaped as the host path's calls take (``[k, ...]`` stacked when calls
        run K > 1): FLOP counts lower the step on its shapes."""
        return self.dataset.stacked(0, k) if k > 1 else self.dataset[0]

    def rows_program(self, one_row: RowStep, scanned: bool) -> Body:
        return cut_on_device(one_row, self, scanned)

    def placed(self, batch_sharding: jax.sharding.NamedSharding,
               replicated: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
        return replicated  # on the run's one device, as the replicated sharding says

    def counted(self, programs: dict[int, Any], example: Any) -> tuple[dict[int, Any], Any]:
        # the whole program would count the gather too: the step alone, on a batch's shapes
        return {}, self.example(2)

    def held(self, k: int) -> tuple[Batch, jax.Array]:
        return self.args(k)

    def take(self, batches: Any, k: int, placement: BatchPlacement,
             stacked: bool) -> tuple[Batch, jax.Array]:
        batches.skip(k)  # the data position moves as the host path's (the checkpoint's)
        return self.args(k)

    def from_offset(self, offset: int) -> ResidentBatches:
        # the offset is traced into the programs: a new one makes new programs
        return self if offset == self.offset else ResidentBatches(self.dataset, offset)


def cut_on_device(one_row: RowStep, resident: ResidentBatches, scanned: bool) -> Body:
    """``one_row`` on batches gathered from ``resident``'s arrays by the step counter: a call
    ``(state, resident.args(...)) -> (state, rows)`` of one step, or of as many as the args'
    length vector under a scan, each step cutting its own batch (``ResidentBatches``)."""

    def call(state: TrainState, args: Any) -> tuple[TrainState, jax.Array]:
        def step(state: TrainState, _: Any) -> tuple[TrainState, jax.Array]:
            return one_row(state, resident.batch(state.step, args))

        k = args[1].shape[0]
        if not scanned:
            return step(state, None)
        if k == 1:  # a one-step tail: as XLA computes the host path's scan of one (it drops
            state, row = step(state, None)  # the loop), not as a scan of one buffer
            return state, row[None]
        return jax.lax.scan(step, state, None, length=k)

    return call


def resident_batches(batches: Any, single_device: bool, data_index: int,
                     step: int) -> ResidentBatches | None:
    """The run's batches on the device when they qualify (module docstring); else None.
    data_index: the data position the run starts at; step: the state's step there."""
    if not (single_device and jax.process_count() == 1 and isinstance(batches, BatchCursor)
            and batches.stacked is not None and isinstance(batches.dataset, ArrayBatches)):
        return None
    dataset = batches.dataset
    size = sum(math.prod(a.shape) * a.dtype.itemsize for a in dataset.arrays.values())
    if size > RESIDENT_MAX_BYTES:
        return None
    if dataset.shuffled:
        return None  # module docstring
    return ResidentBatches(dataset, data_index - step)
