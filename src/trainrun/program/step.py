"""The training step, pure: ``(state, batch) -> (new_state, metrics)``.

Nothing here runs anything; ``loop.py`` jits these functions at the edge with the state donated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax

from trainrun.config import ConfigError
from trainrun.models.adapters import Model
from trainrun.program.optim import Optimizer
from trainrun.program.precision import LossScale, Policy
from trainrun.program.state import TrainState, step_key

Batch = Any
PyTree = Any
Metrics = dict[str, jax.Array]
StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]
KeepIfNot = Callable[[jax.Array, PyTree, PyTree], PyTree]  # (finite, new, old) -> kept
Norm = Callable[[PyTree], jax.Array]  # a tree -> the L2 norm of its leaves together


def keep_if_not(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``finite``, else ``old``: a select of every leaf."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves together, summed in float32 whatever their dtype."""
    # One reduction over the leaves laid end to end: XLA:CPU fuses the concatenation into it, so
    # a small model pays one kernel per norm, not one per leaf (XLA:TPU writes it out instead:
    # fast/leaf_norms.py).
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])
    return jnp.sqrt(jnp.sum(jnp.square(flat)))


def make_train_step(model: Model, optimizer: Optimizer, *, accumulate: int = 1,
                    policy: Policy | None = None, keep: KeepIfNot = keep_if_not,
                    norm: Norm = global_norm) -> StepFn:
    """One optimizer update on one batch.

    accumulate: M > 1 splits the batch into M microbatches (example ``j`` goes to microbatch
        ``j % M``) and scans over them inside this one step, so only one microbatch's
        activations are alive at a time. Microbatch ``i`` draws from ``fold_in(step_key, i)``.
        Gradients, loss and aux are combined weighted by each microbatch's ``weight`` (see
        ``Model``), which makes the result the full-batch gradient also when microbatches hold
        different numbers of valid tokens. The optimizer and its schedule advance once.
    policy: mixed precision (``precision.Policy``); params and floating batch leaves are cast
        to its compute dtype, the loss to its output dtype; float16 scales the loss.
    keep: how the skip below keeps the old state (``keep_if_not``); another must give the
        same bits (``fast/guard.py``'s branches, for a step run under ``lax.scan`` on CPU).
    norm: how the metrics' and the guard's norms are taken (``global_norm``); another agrees
        within float tolerance (``fast/leaf_norms.py``, on a TPU).

    A step whose loss, gradients or update is not finite is not applied: params and opt_state
    (hence the schedule) stay as they were, ``nonfinite_steps`` counts it, and with float16 the
    loss scale halves. ``loop.py`` decides whether the run goes on (``nonfinite`` policy).

    Metrics: ``loss`` (of the params before the update), ``grad_norm`` (before clipping; of the
    trainable params with ``optimizer.trainable``, frozen ones getting no gradient),
    ``update_norm``, ``param_norm`` (after the step), ``lr`` (the value the optimizer used),
    ``nonfinite_steps`` (so far), ``loss_scale`` (float16 only) and the model's aux metrics
    (with the batch's summed ``weight`` under ``Model.weight_name`` where the model names it).
    """
    policy = policy or Policy()
    gradients = make_gradient_fn(model, policy, accumulate, optimizer.trainable)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        loss, aux, grads, model_state = gradients(state.params, batch, step_key(state),
                                                  state.loss_scale, state.model_state)
        grads = policy.unscale_grads(grads, state.loss_scale)
        updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = norm(grads)
        update_norm = norm(updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        params, opt_state, model_state = keep(
            finite, (params, opt_state, model_state),
            (state.params, state.opt_state, state.model_state))
        updates_done = state.step - state.nonfinite_steps
        new_state = state.replace(
            step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
            nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
            loss_scale=policy.adjust(state.loss_scale, finite),
            ema=moving_average(state.ema, params, optimizer.ema, finite))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "param_norm": norm(params),
            "lr": jnp.asarray(optimizer.schedule(updates_done), jnp.float32),
            "nonfinite_steps": new_state.nonfinite_steps,
            **({"loss_scale": state.loss_scale.scale} if policy.scales_loss else {}),
            **aux,
        }
        return new_state, metrics

    return train_step


def moving_average(ema: PyTree, params: PyTree, decay: float | None,
                   applied: jax.Array) -> PyTree:
    """``decay * ema + (1 - decay) * params`` after an applied update (as ``ema + (1 - decay)
    (params - ema)``, in the params' dtype); unchanged after a skipped one or without EMA."""
    if decay is None or ema is None:
        return ema
    rate = 1.0 - decay
    return jax.tree.map(lambda e, p: jnp.where(applied, e + (p - e) * jnp.asarray(rate, e.dtype),
                                               e), ema, params)


GradientFn = Callable[..., tuple[jax.Array, dict[str, jax.Array], PyTree, PyTree]]


def make_gradient_fn(model: Model, policy: Policy, accumulate: int = 1,
                     trainable: Callable[[PyTree], PyTree] | None = None) -> GradientFn:
    """``(params, batch, key, loss_scale) -> (loss, aux, grads)``: the batch's loss, aux metrics
    and gradient (still multiplied by the loss scale under float16), accumulated over
    ``accumulate`` microbatches as ``make_train_step`` describes.

    trainable: params -> bools (``Optimizer.trainable``); a frozen param's gradient is not
    computed and comes back as zeros."""

    def objective(params: PyTree, batch: Batch, key: jax.Array, loss_scale: LossScale,
                  model_state: PyTree = None):
        if trainable is not None:
            # Constants to autodiff: the backward pass then skips the frozen weights' gradients.
            params = jax.tree.map(lambda p, train: p if train else jax.lax.stop_gradient(p),
                                  params, trainable(params))
        args = (policy.cast_to_compute(params), policy.cast_to_compute(batch), key)
        # the model state stays in its own dtype (running statistics in float32)
        loss, aux, model_state = model.loss(*args, model_state)
        aux = dict(aux)
        weight = aux.pop("weight", None)
        # A metric's own weight (``weight/<name>``) is for combining eval batches only.
        aux = {name: value for name, value in aux.items() if not name.startswith("weight/")}
        loss, aux = policy.cast_to_output((loss, aux))
        return policy.scale_loss(loss, loss_scale), (loss, aux, weight, model_state)

    grad = jax.value_and_grad(objective, has_aux=True)

    def whole(params, batch, key, loss_scale, model_state=None):
        (_, (loss, aux, weight, model_state)), grads = grad(params, batch, key, loss_scale,
                                                            model_state)
        return loss, _counted(model, aux, weight), grads, model_state

    if accumulate == 1:
        return whole

    def accumulated(params, batch, key, loss_scale, model_state=None):
        size = jax.tree.leaves(batch)[0].shape[0]
        if size % accumulate:
            raise ConfigError(f"accumulate={accumulate} does not divide the batch of {size} "
                              "examples; pick an accumulate that divides the batch")
        micro = size // accumulate
        # Strided, not contiguous: a device's contiguous shard of the batch then holds its
        # share of every microbatch, so the split moves no data between devices.
        strided = jax.tree.map(lambda x: x.reshape(micro, accumulate, *x.shape[1:]), batch)

        def part(i):
            return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 1, False), strided)

        def one(i, model_state):
            (_, (loss, aux, weight, model_state)), grads = grad(
                params, part(i), jax.random.fold_in(key, i), loss_scale, model_state)
            weight = jnp.asarray(micro if weight is None else weight, jnp.float32)
            return weight, (loss, aux, grads), model_state

        def body(carry, i):
            totals, model_state = carry  # the model state goes from microbatch to microbatch
            weight, values, model_state = one(i, model_state)
            # A microbatch without valid tokens adds nothing, even if its mean came out 0/0.
            add = lambda t, v: t + jnp.where(weight > 0, weight * v.astype(jnp.float32), 0.0)
            return ((totals[0] + weight, jax.tree.map(add, totals[1], values)),
                    model_state), None

        shapes = jax.eval_shape(one, 0, model_state)[1]
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
        ((total, sums), model_state), _ = jax.lax.scan(
            body, ((jnp.zeros((), jnp.float32), zeros), model_state), jnp.arange(accumulate))
        loss, aux, grads = jax.tree.map(lambda t, s: (t / total).astype(s.dtype), sums, shapes)
        return loss, _counted(model, aux, total), grads, model_state

    return accumulated


def _counted(model: Model, aux: Metrics, weight: Any) -> Metrics:
    """``aux`` with the batch's weight under ``model.weight_name`` (where it has one)."""
    if model.weight_name is None or weight is None:
        return aux
    return {**aux, model.weight_name: jnp.asarray(weight, jnp.float32)}


Out = TypeVar("Out")


def make_multi_step(
        train_step: Callable[[TrainState, Batch], tuple[TrainState, Out]],
) -> Callable[[TrainState, Batch], tuple[TrainState, Out]]:
    """K steps in one call: ``batches`` leaves are ``[K, ...]``; each step's metrics come back
    stacked along a new first axis (``[K]`` per metric, or ``[K, n]`` for a packed row)."""

    def multi_step(state: TrainState, batches: Batch) -> tuple[TrainState, Out]:
        return jax.lax.scan(train_step, state, batches)

    return multi_step


def make_eval_step(model: Model, policy: Policy | None = None) -> Callable[[PyTree, Batch],
                                                                          Metrics]:
    """``(params, batch[, model_state]) -> metrics`` on a held-out batch: ``loss`` and the
    model's aux metrics (accuracy, bits per byte, ...) as float32, and ``weight``: what the
    batch's means are over (the model's aux ``weight``, else the number of examples), to
    combine batches. No update
    and no training randomness: the model's ``eval_loss`` (dropout off), else its ``loss`` with
    a fixed key. Reads ``params`` only, so evaluating never changes the training trajectory."""
    policy = policy or Policy()

    def eval_step(params: PyTree, batch: Batch, model_state: PyTree = None) -> Metrics:
        params, batch = policy.cast_to_compute(params), policy.cast_to_compute(batch)
        if model.eval_loss is not None:  # running statistics used, not updated
            loss, aux = model.eval_loss(params, batch, model_state)
        else:
            loss, aux, _ = model.loss(params, batch, jax.random.key(0), model_state)
        metrics = {"loss": loss, "weight": jax.tree.leaves(batch)[0].shape[0], **aux}
        return {name: jnp.asarray(value, jnp.float32) for name, value in metrics.items()}

    return eval_step
