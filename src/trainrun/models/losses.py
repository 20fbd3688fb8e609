"""Losses shared by the models, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

LN2 = math.log(2.0)


def mean_squared_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((predictions.astype(jnp.float32) - targets) ** 2)


def classification(logits: jax.Array,
                   labels: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy over every position of ``labels`` and the accuracy of the argmax."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, {"accuracy": accuracy}


def next_token(logits: jax.Array,
               tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Language-model loss of ``logits`` [B, T, V] against ``tokens`` [B, T] (the inputs shifted
    by one). Also bits per token; for byte tokens (uint8) that is bits per byte, the unit in
    which byte-level models are compared."""
    loss, aux = classification(logits, tokens.astype(jnp.int32))
    unit = "bits_per_byte" if tokens.dtype == jnp.uint8 else "bits_per_token"
    return loss, {**aux, unit: loss / LN2}
