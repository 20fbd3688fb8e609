"""A small state crosses the jit boundary as one flat buffer per dtype.

Every array a jitted call takes or returns costs the dispatch path on the host, about 1-2 µs
each on XLA:CPU. The default MLP's state is 18 arrays (params, Adam's two moments, counters,
key) holding 970 numbers, so the arrays, not the arithmetic, set the price of a call: packed
into three buffers (float32, int32, uint32) trainrun's whole one-step loop takes 38.8 µs a
step instead of 125.4 µs (BENCHMARKS.md, "Loop overhead"). Inside the call the buffers are
sliced back into the ``TrainState`` and the new state is concatenated into new buffers; the
step computes the same bits either way. Only for one device (a sharded state keeps its own
layout per array) and a state small enough that the extra concatenation is noise.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Packed = dict[str, jax.Array]  # dtype name -> flat [n] buffer

PACK_MAX_BYTES = 1 << 20  # above this a step's arithmetic, not its dispatch, sets its time


class StatePacking:
    """Packs and unpacks pytrees shaped like ``abstract`` (traceable both ways)."""

    def __init__(self, abstract: PyTree):
        leaves, self.treedef = jax.tree.flatten(abstract)
        self.shapes = [tuple(leaf.shape) for leaf in leaves]
        self.groups: dict[str, list[int]] = {}  # dtype name -> leaf indices, in leaf order
        for index, leaf in enumerate(leaves):
            self.groups.setdefault(jnp.dtype(leaf.dtype).name, []).append(index)

    def pack(self, tree: PyTree) -> Packed:
        leaves = jax.tree.leaves(tree)
        return {dtype: jnp.concatenate([jnp.ravel(leaves[i]) for i in indices])
                for dtype, indices in self.groups.items()}

    def unpack(self, packed: Packed) -> PyTree:
        leaves: list[Any] = [None] * len(self.shapes)
        for dtype, indices in self.groups.items():
            offset = 0
            for i in indices:
                size = math.prod(self.shapes[i])
                leaves[i] = packed[dtype][offset:offset + size].reshape(self.shapes[i])
                offset += size
        return jax.tree.unflatten(self.treedef, leaves)


def packing_for(abstract: PyTree, device_count: int) -> StatePacking | None:
    """The packing a run's state gets: one device and at most ``PACK_MAX_BYTES``; else None."""
    leaves = jax.tree.leaves(abstract)
    size = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    if device_count != 1 or size > PACK_MAX_BYTES or len(leaves) < 2:
        return None
    return StatePacking(abstract)
