"""Rows of a table gathered by index (``table[ids]``, an embedding lookup) with a gradient that
is deterministic by construction: no scatter-add into the table, so no atomic adds whose order
changes between runs on a GPU, and no need for XLA's slow deterministic scatter.

The gradient sorts the ids (a stable sort), sums each id's rows of the incoming gradient with a
segmented scan over the sorted order (a fixed tree of adds, in float32), and gathers each table
row's sum from the last position of its id, found by binary search. Every step is a sort, a
gather or a scan: bitwise the same on every run, equal to the scatter gradient within float
rounding (the adds are grouped otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]``: ``[vocab, d]`` rows at integer ``ids`` of any shape, ``ids.shape + (d,)``.
    Ids outside ``[0, vocab)`` are clamped to it, on the forward and the backward pass alike
    (``jnp.take``'s ``mode="clip"``)."""
    return jnp.take(table, ids, axis=0, mode="clip")


def _forward(table: jax.Array, ids: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    # the table's rows count and dtype travel as a zero-size array: residuals must be arrays
    return gather_rows(table, ids), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _backward(residuals: tuple[jax.Array, jax.Array],
              cotangent: jax.Array) -> tuple[jax.Array, None]:
    ids, shape_of = residuals
    vocab, dtype = shape_of.shape[0], shape_of.dtype
    flat_ids = jnp.clip(ids.reshape(-1).astype(jnp.int32), 0, vocab - 1)
    rows = cotangent.reshape(flat_ids.shape[0], -1).astype(jnp.float32)
    order = jnp.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])

    def add_within_segment(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
                           ) -> tuple[jax.Array, jax.Array]:
        start_a, sum_a = a
        start_b, sum_b = b
        return start_a | start_b, jnp.where(start_b[..., None], sum_b, sum_a + sum_b)

    _, sums = jax.lax.associative_scan(add_within_segment, (starts, rows[order]))
    last = jnp.searchsorted(sorted_ids, jnp.arange(vocab, dtype=jnp.int32), side="right") - 1
    at = jnp.clip(last, 0, sorted_ids.shape[0] - 1)
    present = (last >= 0) & (sorted_ids[at] == jnp.arange(vocab, dtype=jnp.int32))
    grad = jnp.where(present[:, None], sums[at], 0.0)
    return grad.astype(dtype), None


gather_rows.defvjp(_forward, _backward)
