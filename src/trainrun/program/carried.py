"""How the step programs carry the state across the jit boundary: ``StateCarrier``, and the
plain carrier, ``TrainStateCarrier``, which passes the ``TrainState`` itself, leaf by leaf.
Another carrier carries the same bits in another form (``fast/packing.py``'s flat buffers).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from trainrun.program.state import TrainState

Body = Any  # (carried, batch) -> (carried, rows)


class StateCarrier(Protocol):
    """The form of the state the calls take and return, and the conversions to it and back."""

    # ``state`` gives new arrays: a later call may donate ``carried`` while they are in use
    fresh_arrays: bool

    def around(self, body: Body) -> Body:
        """``body``, written on ``TrainState``s, on what the calls carry."""
        ...

    def carry(self, state: TrainState) -> Any:
        """``state`` as the calls take it."""
        ...

    def state(self, carried: Any) -> TrainState:
        """The ``TrainState`` in ``carried``."""
        ...

    def sharding(self, state_sharding: TrainState | None) -> Any:
        """What the calls pin the carried state to (None: nothing)."""
        ...

    def shapes(self, abstract: TrainState, state_sharding: TrainState | None) -> Any:
        """The shapes, dtypes and placements of what the calls carry, from the abstract state
        and its shardings."""
        ...


class TrainStateCarrier:
    """The calls carry the ``TrainState`` itself, pinned to the state's shardings."""

    fresh_arrays = False

    def around(self, body: Body) -> Body:
        return body

    def carry(self, state: TrainState) -> Any:
        return state

    def state(self, carried: Any) -> TrainState:
        return carried

    def sharding(self, state_sharding: TrainState | None) -> Any:
        return state_sharding

    def shapes(self, abstract: TrainState, state_sharding: TrainState | None) -> Any:
        if state_sharding is None:
            return abstract
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sharding)
