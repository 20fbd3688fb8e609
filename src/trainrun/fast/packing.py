"""A small one-device state crosses the jit boundary as one flat buffer per dtype
(``state_packing``): ``PackedState``, the ``StateCarrier`` (``program/carried.py``) the step
programs take in place of the ``TrainState`` itself.

Each array a call takes or returns costs the host's dispatch path, which on a tiny model costs
more than the arithmetic. Inside the call the buffers are sliced back into the ``TrainState``
and the new state is concatenated into new buffers: the same bits either way. On CPU the slices
are cut one after another, so XLA:CPU never finds enough ready kernels to hand them to its
thread pool. Why, and what it buys: docs/internals.md, "Fast paths".
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.program.carried import Body
from trainrun.program.state import TrainState

PyTree = Any
Packed = dict[str, jax.Array]  # dtype name -> flat [n] buffer

PACK_MAX_BYTES = 1 << 20  # above this a step's arithmetic, not its dispatch, sets its time
# Above this the ordered slices' compile time (about quadratic in their number) outweighs the
# dispatch saved: a small LoRA state has the many leaves of its frozen base.
PACK_MAX_LEAVES = 32


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
    """The packing a run's state gets: one device, at most ``PACK_MAX_BYTES`` and 2 to
    ``PACK_MAX_LEAVES`` leaves; else None."""
    leaves = jax.tree.leaves(abstract)
    size = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    if (device_count != 1 or size > PACK_MAX_BYTES
            or not 2 <= len(leaves) <= PACK_MAX_LEAVES):
        return None
    return StatePacking(abstract)


class PackedState:
    """A ``StateCarrier``: the calls carry ``packing``'s flat buffers, unpinned (one device)."""

    fresh_arrays = True  # unpacking makes new arrays

    def __init__(self, packing: StatePacking):
        self.packing = packing
        self._carry, self._state = jax.jit(packing.pack), jax.jit(packing.unpack)

    def around(self, body: Body) -> Body:
        packing = self.packing

        def packed_body(carried: Packed, batch: Any) -> tuple[Packed, jax.Array]:
            state, rows = body(packing.unpack(carried), batch)
            return packing.pack(state), rows

        return packed_body

    def carry(self, state: TrainState) -> Packed:
        return self._carry(state)

    def state(self, carried: Packed) -> TrainState:
        return self._state(carried)

    def sharding(self, state_sharding: TrainState | None) -> None:
        return None

    def shapes(self, abstract: TrainState, state_sharding: TrainState | None) -> Any:
        packed = jax.eval_shape(self.packing.pack, abstract)
        if state_sharding is None:
            return packed
        # one device: the packed buffers come out of ``carry`` whole, on the state's mesh
        mesh = jax.tree.leaves(state_sharding)[0].mesh
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole),
                            packed)
