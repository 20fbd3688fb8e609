"""Batches gathered on the device, a fast path (``resident_batches`` in
``platform/fast_paths.py``): a small in-memory dataset placed there once, each step's batch cut
from it inside the jitted call, so no host array crosses into a call.

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
        if k not in self._lengths:
            self._lengths[k] = jnp.zeros(k, jnp.int32)
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
