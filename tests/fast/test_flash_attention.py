"""The Pallas flash attention (interpreted on CPU) computes the model's causal attention:
outputs and gradients equal, packed segments and grouped key/value heads included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.fast.flash_attention import flash_causal_attention, supports
from trainrun.models.transformer import causal_attention


def _inputs(seq: int, heads: int, kv_heads: int, packed: bool
            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    draw = np.random.default_rng(seq + heads)
    q = jnp.asarray(draw.normal(size=(2, seq, heads, 16)), jnp.float32)
    k, v = (jnp.asarray(draw.normal(size=(2, seq, kv_heads, 16)), jnp.float32)
            for _ in range(2))
    segments = None
    if packed:  # three documents in the first row, two in the second, padding at the end
        cut = [seq // 3, seq // 2, seq - 3]
        rows = np.zeros((2, seq), np.int32)
        rows[0, :cut[0]], rows[0, cut[0]:cut[2]] = 1, 2
        rows[0, cut[2]:] = 3
        rows[1, :cut[1]], rows[1, cut[1]:cut[2]] = 1, 2
        segments = jnp.asarray(rows)
    return q, k, v, segments


@pytest.mark.slow  # the kernels run in Pallas' interpreter
@pytest.mark.parametrize("seq,heads,kv_heads,packed", [(40, 2, 2, True), (70, 4, 2, False),
                                                       (33, 2, 1, True)])
def test_outputs_and_gradients_equal_the_xla_form(seq: int, heads: int, kv_heads: int,
                                                  packed: bool) -> None:
    q, k, v, segments = _inputs(seq, heads, kv_heads, packed)
    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)

    def loss(attend):  # type: ignore[no-untyped-def]
        return lambda q, k, v: jnp.sum(attend(q, k, v, segments, scale=0.3) * cotangent)

    def grouped(q, k, v, segments, scale):  # type: ignore[no-untyped-def]
        """The model's attention, its key/value heads repeated as the model repeats them."""
        groups = q.shape[2] // k.shape[2]
        k, v = (jnp.repeat(t, groups, axis=2) for t in (k, v))
        return causal_attention(q, k, v, segments, scale=scale)

    flash = jax.jit(jax.value_and_grad(loss(flash_causal_attention), argnums=(0, 1, 2)))
    plain = jax.jit(jax.value_and_grad(loss(grouped), argnums=(0, 1, 2)))
    (value, grads), (want, want_grads) = flash(q, k, v), plain(q, k, v)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=5e-5)
    out = jax.jit(lambda q, k, v: flash_causal_attention(q, k, v, segments, scale=0.3))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(grouped(q, k, v, segments, 0.3)),
                               atol=2e-6)


def test_the_program_holds_the_kernel_forward_and_backward() -> None:
    q, k, v, segments = _inputs(32, 2, 2, True)
    jaxpr = str(jax.make_jaxpr(jax.grad(
        lambda q: flash_causal_attention(q, k, v, segments).sum()))(q))
    names = [line for line in jaxpr.splitlines() if "pallas_call" in line]
    assert any("mha_forward" in line for line in jaxpr.splitlines())
    assert any("mha_backward" in line for line in jaxpr.splitlines()) and names


def test_what_the_kernel_does_not_compute_is_said() -> None:
    assert supports(None, None) and supports(None, 0.0)
    assert not supports(4096, None) and not supports(None, 50.0)
