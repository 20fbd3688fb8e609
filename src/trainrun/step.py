"""The training step, pure: ``(state, batch) -> (new_state, metrics)``.

Nothing here runs anything; ``loop.py`` jits these functions at the edge with the state donated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainrun.models.adapters import Model
from trainrun.optim import Optimizer
from trainrun.state import TrainState, step_key

Batch = Any
Metrics = dict[str, jax.Array]
StepFn = Callable[[TrainState, Batch], tuple[TrainState, Metrics]]


def make_train_step(model: Model, optimizer: Optimizer) -> StepFn:
    """One optimizer update.

    Metrics: ``loss`` (of the params before the update, as value_and_grad computes it),
    ``grad_norm`` (global L2 norm), ``lr`` (the schedule's value at this step) and the model's
    aux metrics.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        grad_fn = jax.value_and_grad(model.loss, has_aux=True)
        (loss, aux), grads = grad_fn(state.params, batch, step_key(state))
        updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "lr": jnp.asarray(optimizer.schedule(state.step), jnp.float32),
            **aux,
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_multi_step(train_step: StepFn) -> StepFn:
    """K steps in one call: ``batches`` leaves are ``[K, ...]``; metrics come back ``[K]``."""

    def multi_step(state: TrainState, batches: Batch) -> tuple[TrainState, Metrics]:
        return jax.lax.scan(train_step, state, batches)

    return multi_step
