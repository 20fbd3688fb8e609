"""Matmuls the models share: attention scores accumulated in float32 with a backward pass in
the operands' own dtype."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def float32_dot(a: jax.Array, b: jax.Array, dimension_numbers: Any) -> jax.Array:
    """``lax.dot_general(a, b, dimension_numbers)`` accumulated and returned in float32, whose
    backward pass also multiplies in ``a``'s dtype.

    For scores that feed a float32 softmax (attention logits): autodiff of a plain
    ``preferred_element_type=float32`` matmul would multiply the float32 cotangent by the
    half-precision operands, which promotes both backward matmuls to float32. Here the
    cotangent is rounded to ``a``'s dtype first, as it would be had the matmul returned that
    dtype. For float32 operands it is the plain matmul."""
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)
    return _float32_dot(a, b, _hashable(dimension_numbers))


def _hashable(dimension_numbers: Any) -> Any:
    return tuple(tuple(tuple(d) for d in part) for part in dimension_numbers)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _float32_dot(a: jax.Array, b: jax.Array, dimension_numbers: Any) -> jax.Array:
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


def _float32_dot_fwd(a, b, dimension_numbers):
    return _float32_dot(a, b, dimension_numbers), (a, b)


def _float32_dot_bwd(dimension_numbers, residuals, g):
    a, b = residuals
    _, pullback = jax.vjp(lambda a, b: jax.lax.dot_general(
        a, b, dimension_numbers, preferred_element_type=a.dtype), a, b)
    return pullback(g.astype(a.dtype))


_float32_dot.defvjp(_float32_dot_fwd, _float32_dot_bwd)
