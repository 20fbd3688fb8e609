"""A small state crosses the jit boundary as one flat buffer per dtype.

Every array a jitted call takes or returns costs the dispatch path on the host, about 1-2 µs
each on XLA:CPU. The default MLP's state is 18 arrays (params, Adam's two moments, counters,
key) holding 970 numbers, so the arrays, not the arithmetic, set the price of a call: packed
into three buffers (float32, int32, uint32) trainrun's whole one-step loop takes 38.8 µs a
step instead of 125.4 µs (BENCHMARKS.md, "Loop overhead"). Inside the call the buffers are
sliced back into the ``TrainState`` and the new state is concatenated into new buffers; the
step computes the same bits either way. Only for one device (a sharded state keeps its own
layout per array) and a state small enough that the extra concatenation is noise.

On CPU the slices are cut one after another. XLA:CPU's thunk executor runs a program's kernels
in the calling thread until more than 8 of them are ready at once; then it hands half of them
to its thread pool, and the call ends on a pool thread with the caller asleep. The default
MLP's slices were all ready at a program's start, so every call woke the pool (about 2
voluntary context switches a call) and paid for it, most after the host had been busy: its
step program at K=10, 23.1 against 33.5 µs a step called back to back, and 27.8 against 53.5
after 1 ms of host work (Intel Xeon, 2 CPUs, best of 5; ``benchmarks/host_gap.py``).
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
        """The tree; on CPU each leaf's slice is ordered after the previous one (module
        docstring), elsewhere they are independent."""
        return jax.lax.platform_dependent(packed, cpu=lambda p: self._unpack(p, in_order=True),
                                          default=lambda p: self._unpack(p, in_order=False))

    def _unpack(self, packed: Packed, in_order: bool) -> PyTree:
        leaves: list[Any] = [None] * len(self.shapes)
        previous = None
        for dtype, indices in self.groups.items():
            offset = 0
            for i in indices:
                size = math.prod(self.shapes[i])
                if previous is None:
                    leaf = packed[dtype][offset:offset + size]
                else:
                    leaf = jax.lax.dynamic_slice_in_dim(packed[dtype],
                                                        offset + zero_after(previous), size)
                leaves[i] = leaf.reshape(self.shapes[i])
                if in_order and size and not jnp.issubdtype(dtype, jnp.complexfloating):
                    previous = leaves[i]
                offset += size
        return jax.tree.unflatten(self.treedef, leaves)


_BITS = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}  # integer of each width


def zero_after(previous: jax.Array) -> jax.Array:
    """An int32 0 computed from the bits of ``previous``'s first element and a mask XLA cannot
    see is 0 (behind an optimization barrier), so it cannot fold it away: a kernel that uses
    it reads ``previous``'s buffer, and the thunk executor runs it after the kernel that wrote
    ``previous``. Bits, not a conversion: a float's NaN or infinity converts to no defined
    integer."""
    first = jnp.ravel(previous)[0]
    bits = (first.astype(jnp.int32) if first.dtype == jnp.bool_ else
            jax.lax.bitcast_convert_type(first, _BITS[first.dtype.itemsize]).astype(jnp.int32))
    return bits & jax.lax.optimization_barrier(jnp.zeros((), jnp.int32))


def packing_for(abstract: PyTree, device_count: int) -> StatePacking | None:
    """The packing a run's state gets: one device and at most ``PACK_MAX_BYTES``; else None."""
    leaves = jax.tree.leaves(abstract)
    size = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    if device_count != 1 or size > PACK_MAX_BYTES or len(leaves) < 2:
        return None
    return StatePacking(abstract)
