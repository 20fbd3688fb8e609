"""The one shape of model the step knows: ``init(key) -> params`` and
``loss(params, batch, key) -> (loss, aux_metrics)``. Adapters bring plain functions and Flax
NNX modules to it; params are plain nested dicts of arrays either way, so Optax, Orbax and
sharding rules see the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

PyTree = Any
Batch = Any
LossFn = Callable[[PyTree, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class Model:
    """What the training step needs of a model.

    init: ``key -> params`` (a pytree of float arrays).
    loss: ``(params, batch, key) -> (scalar loss, dict of scalar aux metrics)``; ``key`` is the
        step's randomness (dropout), already folded with the step number.
    name: shown in logs and checkpoint metadata.
    logical_axes: optional pytree shaped like params whose leaves are tuples naming each
        dimension of that param (e.g. ``("embed", "mlp")``, ``None`` for an unnamed dim);
        sharding rules map these names onto mesh axes (tensor parallelism).
    """

    init: Callable[[jax.Array], PyTree]
    loss: LossFn
    name: str = "model"
    logical_axes: PyTree | None = None


def from_functions(init: Callable[[jax.Array], PyTree], loss: Callable[..., Any],
                   name: str = "model") -> Model:
    """Plain functions. ``loss`` may return a scalar or ``(scalar, aux_dict)``."""

    def loss_with_aux(params: PyTree, batch: Batch, key: jax.Array):
        out = loss(params, batch, key)
        return out if isinstance(out, tuple) else (out, {})

    return Model(init=init, loss=loss_with_aux, name=name)


def from_nnx(make_module: Callable[[nnx.Rngs], nnx.Module],
             loss: Callable[[nnx.Module, Batch, jax.Array], Any], name: str = "model") -> Model:
    """A Flax NNX module, trained through ``nnx.split`` / ``nnx.merge``.

    make_module: ``rngs -> module``; called with ``nnx.Rngs(params=key)`` at init.
    loss: ``(module, batch, key) -> loss`` or ``(loss, aux)``; pass ``rngs=nnx.Rngs(key)`` to
        dropout layers inside it, so their randomness is the step key.

    The trained state is the module's ``nnx.Param`` variables as a plain dict; other variable
    kinds (batch statistics, stored RNG counters) would be silently frozen, so they are refused.
    """
    abstract = nnx.eval_shape(lambda: make_module(nnx.Rngs(params=0)))
    graphdef, param_state, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
            rest, is_leaf=lambda x: isinstance(x, nnx.Variable))})
        raise ValueError(f"module {name!r} holds non-parameter state ({', '.join(kinds)}); "
                         "trainrun trains nnx.Param only: pass rngs at call time instead")

    def init(key: jax.Array) -> PyTree:
        module = make_module(nnx.Rngs(params=key))
        return nnx.to_pure_dict(nnx.state(module, nnx.Param))

    def module_loss(params: PyTree, batch: Batch, key: jax.Array):
        state = jax.tree.map(lambda leaf: leaf, param_state)  # a fresh copy to fill per trace
        nnx.replace_by_pure_dict(state, params)
        out = loss(nnx.merge(graphdef, state), batch, key)
        return out if isinstance(out, tuple) else (out, {})

    return Model(init=init, loss=module_loss, name=name)
