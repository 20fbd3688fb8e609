"""The scatter-free gradient of a row gather: equal to the scatter gradient, bitwise repeatable,
and no scatter in the compiled backward."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.models.row_gather import gather_rows


def _loss(gather):  # type: ignore[no-untyped-def]
    def loss(table: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
        return jnp.sum(gather(table, ids).astype(jnp.float32) * weights)

    return loss


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_equals_the_scatter_gradient(dtype: jnp.dtype) -> None:
    draw = np.random.default_rng(0)
    vocab, d = 37, 8
    table = jnp.asarray(draw.normal(size=(vocab, d)), dtype)
    # repeated ids, ids never drawn, and the first and last row
    ids = jnp.asarray(np.concatenate([draw.integers(0, 12, 60), [0, vocab - 1, vocab - 1]])
                      .reshape(7, 9).astype(np.int32))
    weights = jnp.asarray(draw.normal(size=(7, 9, d)), jnp.float32)
    ours = jax.jit(jax.grad(_loss(gather_rows)))(table, ids, weights)
    plain = jax.grad(_loss(lambda t, i: jnp.take(t, i, axis=0)))(table.astype(jnp.float32), ids,
                                                                   weights)
    assert ours.dtype == dtype and ours.shape == table.shape
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(plain), rtol=tolerance,
                               atol=tolerance)
    untouched = np.setdiff1d(np.arange(vocab), np.asarray(ids))
    assert not np.asarray(ours, np.float32)[untouched].any()
    np.testing.assert_array_equal(np.asarray(gather_rows(table, ids)),
                                  np.asarray(jnp.take(table, ids, axis=0)))


def test_the_compiled_backward_holds_no_scatter_and_repeats_bitwise() -> None:
    table = jnp.ones((64, 4), jnp.float32)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 32)), jnp.int32)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(4, 32, 4)), jnp.float32)
    grad = jax.jit(jax.grad(_loss(gather_rows)))
    scatter = re.compile(r"\sscatter\(")  # the instruction, not a name in the metadata
    assert not scatter.search(grad.lower(table, ids, weights).compile().as_text())
    plain = jax.jit(jax.grad(_loss(lambda t, i: jnp.take(t, i, axis=0))))
    assert scatter.search(plain.lower(table, ids, weights).compile().as_text())  # the old way
    first = np.asarray(grad(table, ids, weights))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(grad(table, ids, weights)), first)


def test_out_of_range_ids_are_clamped_both_ways() -> None:
    table = jnp.arange(12.0).reshape(4, 3)
    ids = jnp.asarray([-2, 5, 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(gather_rows(table, ids)),
                                  np.asarray(table)[[0, 3, 1]])
    grad = jax.jit(jax.grad(lambda t: gather_rows(t, ids).sum()))(table)
    np.testing.assert_array_equal(np.asarray(grad), [[1] * 3, [1] * 3, [0] * 3, [1] * 3])
