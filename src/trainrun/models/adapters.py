"""The one shape of model the step knows: ``init(key) -> params`` and
``loss(params, batch, key, model_state) -> (loss, aux_metrics, model_state)``. Adapters bring
plain functions and Flax
NNX modules to it; params are plain nested dicts of arrays either way, so Optax, Orbax and
sharding rules see the same thing.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax
from flax import nnx

PyTree = Any
Batch = Any
M = TypeVar("M", bound=nnx.Module)
Aux = dict[str, jax.Array]
LossFn = Callable[..., tuple[jax.Array, Aux, PyTree]]  # (params, batch, key, model_state=None)
EvalLossFn = Callable[..., tuple[jax.Array, Aux]]  # (params, batch, model_state=None)


@dataclasses.dataclass(frozen=True)
class Model:
    """What the training step needs of a model.

    init: ``key -> params`` (a pytree of float arrays).
    loss: ``(params, batch, key, model_state=None) -> (scalar loss, dict of scalar aux
        metrics, new model_state)``; ``key`` is the step's randomness (dropout), already folded
        with the step number; ``model_state`` is None for a model without one. The loss is a mean
        over the batch's examples, or over its valid tokens when the batch is padded (e.g.
        ``sum(mask * token_loss) / max(sum(mask), 1)``); then aux ``"weight"`` is that count
        (``sum(mask)``). Gradient accumulation weighs each microbatch by its ``weight`` (the
        number of examples when absent), so the accumulated gradient is the full batch's. The
        step takes ``weight`` out of aux; it is logged only under ``weight_name``. An aux
        metric over something else (bits per byte: over bytes) may give its own
        ``weight/<name>``; eval combines batches of that metric by it, training leaves it out.
    name: shown in logs and checkpoint metadata.
    logical_axes: optional pytree shaped like params whose leaves are tuples naming each
        dimension of that param (e.g. ``("embed", "mlp")``, ``None`` for an unnamed dim);
        sharding rules map these names onto mesh axes (tensor parallelism).
    eval_loss: optional ``(params, batch, model_state=None) -> (loss, aux)`` without training
        randomness (dropout off; running statistics used, not updated), used on the held-out
        split; without it eval calls ``loss`` with a fixed key.
    init_model_state: optional ``key -> model_state``: variables the model updates as it
        trains but no optimizer touches (BatchNorm's running statistics). The state keeps it
        beside the params (``TrainState.model_state``): checkpointed, restored, kept as it was
        by a skipped step.
    weight_name: optional name under which each training step logs its whole batch's
        ``weight`` (summed over microbatches), where that count says what a step trained
        (``pairs``: a preference batch's rows hold as many pairs as fit).
    """

    init: Callable[[jax.Array], PyTree]
    loss: LossFn
    name: str = "model"
    logical_axes: PyTree | None = None
    eval_loss: EvalLossFn | None = None
    init_model_state: Callable[[jax.Array], PyTree] | None = None
    weight_name: str | None = None


def from_functions(init: Callable[[jax.Array], PyTree], loss: Callable[..., Any],
                   name: str = "model") -> Model:
    """Plain functions. ``loss`` may return a scalar or ``(scalar, aux_dict)``."""

    def loss_with_aux(params: PyTree, batch: Batch, key: jax.Array,
                      model_state: PyTree = None) -> tuple[jax.Array, Aux, PyTree]:
        value, aux = _with_aux(loss(params, batch, key))
        return value, aux, model_state

    return Model(init=init, loss=loss_with_aux, name=name)


def from_nnx(make_module: Callable[[nnx.Rngs], M],
             loss: Callable[[M, Batch, jax.Array | None], Any], name: str = "model",
             eval_loss: Callable[[M, Batch], Any] | None = None,
             same_module: Hashable | None = None) -> Model:
    """A Flax NNX module, trained through ``nnx.split`` / ``nnx.merge``.

    make_module: ``rngs -> module``; called with ``nnx.Rngs(params=key)`` at init.
    loss: ``(module, batch, key) -> loss`` or ``(loss, aux)``; pass ``rngs=nnx.Rngs(key)`` to
        dropout layers inside it, so their randomness is the step key.
    eval_loss: ``(module, batch) -> loss`` or ``(loss, aux)`` with dropout off, for eval.

    A param created with ``axes=(...)`` metadata (``nnx.Param(value, axes=("embed", "mlp"))``
    or a layer's ``kernel_metadata={"axes": ...}``) gives the model's ``logical_axes``.

    The trained state is the module's ``nnx.Param`` variables as a plain dict. Other variables
    (``nnx.BatchStat`` and kinds of one's own) are the model state: the module runs in training
    mode (``module.train()``) in ``loss``, which returns their new values, and in eval mode
    (``module.eval()``: running averages used, not updated) in ``eval_loss``. Stored RNG
    counters (``nnx.Rngs`` kept in the module) are refused: pass rngs at call time instead.

    same_module: a key naming what ``make_module`` builds; calls (here or in ``bind_params``)
    with the same key trace the module's shapes once in a process.
    """
    module, param_state, rest = _binder(make_module, name, same_module)
    axes = _axes(param_state)

    def init(key: jax.Array) -> PyTree:
        built = make_module(nnx.Rngs(params=key))
        return nnx.to_pure_dict(nnx.state(built, nnx.Param))

    _INIT_SHAPES[init] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      nnx.to_pure_dict(param_state))
    if not jax.tree.leaves(rest):
        def module_loss(params: PyTree, batch: Batch, key: jax.Array,
                        model_state: PyTree = None) -> tuple[jax.Array, Aux, PyTree]:
            value, aux = _with_aux(loss(module(params), batch, key))
            return value, aux, model_state

        def module_eval_loss(params: PyTree, batch: Batch,
                             model_state: PyTree = None) -> tuple[jax.Array, Aux]:
            assert eval_loss is not None
            return _with_aux(eval_loss(module(params), batch))

        return Model(init=init, loss=module_loss, name=name, logical_axes=axes,
                     eval_loss=module_eval_loss if eval_loss is not None else None)

    def init_model_state(key: jax.Array) -> PyTree:
        built = make_module(nnx.Rngs(params=key))
        return nnx.to_pure_dict(nnx.state(built, nnx.Not(nnx.Param)))

    def stateful_loss(params: PyTree, batch: Batch, key: jax.Array,
                      model_state: PyTree = None) -> tuple[jax.Array, Aux, PyTree]:
        bound = module(params, model_state)
        bound.train()
        loss_value, aux = _with_aux(loss(bound, batch, key))
        return loss_value, aux, nnx.to_pure_dict(nnx.state(bound, nnx.Not(nnx.Param)))

    def stateful_eval_loss(params: PyTree, batch: Batch,
                           model_state: PyTree = None) -> tuple[jax.Array, Aux]:
        bound = module(params, model_state)
        bound.eval()
        return _with_aux((eval_loss or (lambda m, b: loss(m, b, None)))(bound, batch))

    return Model(init=init, loss=stateful_loss, name=name, logical_axes=axes,
                 eval_loss=stateful_eval_loss, init_model_state=init_model_state)


# Each NNX init's params as shapes and dtypes, traced once with the module (``from_nnx``), so
# the state's shapes need no second trace of the module; keyed by the init function itself, so
# a model given another init is traced as before.
_INIT_SHAPES: weakref.WeakKeyDictionary[Callable[..., PyTree], PyTree] = (
    weakref.WeakKeyDictionary())


def init_shapes(init: Callable[[jax.Array], PyTree]) -> PyTree | None:
    """The shapes and dtypes (``jax.ShapeDtypeStruct``) of the params ``init`` returns, where
    ``from_nnx`` made it and traced its module already; None for any other init."""
    return _INIT_SHAPES.get(init)


def _with_aux(out: Any) -> tuple[jax.Array, Aux]:
    """A loss function's result as ``(loss, aux)``: a bare scalar has no aux metrics."""
    return out if isinstance(out, tuple) else (out, {})


def bind_params(make_module: Callable[[nnx.Rngs], M], name: str = "model",
                same_module: Hashable | None = None) -> Callable[..., M]:
    """``(params[, model_state]) -> module``: the module ``make_module`` builds, holding
    ``params`` (a pure dict, e.g. restored from a checkpoint). Traceable: use it inside jitted
    functions. ``same_module`` as for ``from_nnx``."""
    return _binder(make_module, name, same_module)[0]


# Binders by the caller's key for the module they build: loading a model and decoding from it
# trace its shapes once. Few entries: a process builds a handful of models.
_BINDERS: dict[Hashable, tuple[Callable[..., Any], nnx.State, nnx.State]] = {}
_BINDERS_KEPT = 8


def _binder(make_module: Callable[[nnx.Rngs], M], name: str, same_module: Hashable | None
            ) -> tuple[Callable[..., M], nnx.State, nnx.State]:
    if same_module is None:
        return _new_binder(make_module, name)
    if same_module not in _BINDERS:
        while len(_BINDERS) >= _BINDERS_KEPT:
            del _BINDERS[next(iter(_BINDERS))]
        _BINDERS[same_module] = _new_binder(make_module, name)
    return _BINDERS[same_module]


def _new_binder(make_module: Callable[[nnx.Rngs], M],
                name: str) -> tuple[Callable[..., M], nnx.State, nnx.State]:
    abstract = nnx.eval_shape(lambda: make_module(nnx.Rngs(params=0)))
    graphdef, param_state, rest = nnx.split(abstract, nnx.Param, ...)  # type: ignore[misc]  # flax types split's filters as one variadic tuple
    rng = [v for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
           if isinstance(v, nnx.RngState)]
    if rng:
        kinds = sorted({type(v).__name__ for v in rng})
        raise ValueError(f"module {name!r} keeps random-number state ({', '.join(kinds)}); "
                         "trainrun draws randomness from the step key: pass rngs at call time "
                         "instead of storing nnx.Rngs in the module")

    def module(params: PyTree, model_state: PyTree | None = None) -> M:
        state = jax.tree.map(lambda leaf: leaf, param_state)  # a fresh copy to fill per trace
        nnx.replace_by_pure_dict(state, params)
        if not jax.tree.leaves(rest):
            return nnx.merge(graphdef, state)
        others = jax.tree.map(lambda leaf: leaf, rest)
        if model_state is not None:
            nnx.replace_by_pure_dict(others, model_state)
        return nnx.merge(graphdef, state, others)

    return module, param_state, rest


def _axes(param_state: nnx.State) -> PyTree | None:
    """The ``axes`` metadata of each param as a pure-dict pytree of tuples (all ``None`` for a
    param without it); None when no param names its axes."""
    found = False

    def names(variable: nnx.Variable) -> tuple[str | None, ...]:
        nonlocal found
        axes = variable.get_metadata().get("axes")
        found = found or axes is not None
        return tuple(axes) if axes is not None else (None,) * len(variable.shape)

    flat = {path: names(v) for path, v in nnx.to_flat_state(param_state)}
    tree: dict[Any, Any] = {}
    for path, axes in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = axes
    return tree if found else None
