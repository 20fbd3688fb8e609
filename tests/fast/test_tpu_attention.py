"""Splash attention (interpreted on CPU) computes the model's causal attention: outputs and
gradients equal XLA's form with grouped key/value heads and packed documents; inputs it does
not take fall back to the plain path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.fast.tpu_attention import SplashAttention
from trainrun.models.transformer import AttentionPath, SharedPrefixes, causal_attention

SEQ = 256


def _inputs(heads: int, kv_heads: int) -> tuple[jax.Array, ...]:
    draw = np.random.default_rng(heads)
    q = jnp.asarray(draw.normal(size=(2, SEQ, heads, 32)), jnp.float32)
    k, v = (jnp.asarray(draw.normal(size=(2, SEQ, kv_heads, 32)), jnp.float32)
            for _ in range(2))
    return q, k, v


@pytest.mark.slow  # the kernels run in Pallas' interpreter
@pytest.mark.parametrize("heads,kv_heads,packed,fused,seq_minor", [
    (4, 2, False, True, "kv"), (2, 2, True, False, "qkv"), (4, 2, True, True, "")])
def test_outputs_and_gradients_equal_the_xla_form(heads, kv_heads, packed, fused, seq_minor):
    q, k, v = _inputs(heads, kv_heads)
    segments = None
    if packed:  # two documents in the first row; padding (segment 0) ending the second
        rows = np.ones((2, SEQ), np.int32)
        rows[0, 100:], rows[1, 200:] = 2, 0
        segments = jnp.asarray(rows)
    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)
    splash = AttentionPath(kernel=SplashAttention(128, 128, fused, seq_minor=seq_minor))

    def loss(path):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(causal_attention(
            q, k, v, segments, scale=0.3, path=path) * cotangent), argnums=(0, 1, 2)))

    (value, grads), (want, want_grads) = loss(splash)(q, k, v), loss(AttentionPath())(q, k, v)
    assert splash.kernel is not None and splash.kernel.supports(q, k, segments, None, None)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=5e-5)


def test_the_program_holds_the_kernel_and_grouped_heads_are_not_repeated():
    q, k, v = _inputs(4, 2)
    path = AttentionPath(kernel=SplashAttention(128, 128))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda q, k, v: causal_attention(
        q, k, v, path=path).sum(), argnums=(0, 1, 2)))(q, k, v))
    assert "pallas_call" in jaxpr and "splash" in jaxpr
    repeated = "f32[2,256,2,2,32]"  # each key/value head broadcast to its two query heads
    assert repeated not in jaxpr
    plain = str(jax.make_jaxpr(lambda q, k, v: causal_attention(q, k, v))(q, k, v))
    assert repeated in plain and "pallas_call" not in plain


def test_keys_and_values_are_read_sequence_minor_unless_told():
    q, k, v = _inputs(4, 2)

    def program(kernel: SplashAttention) -> str:
        path = AttentionPath(kernel=kernel)
        return str(jax.make_jaxpr(jax.grad(lambda q, k, v: causal_attention(
            q, k, v, path=path).sum(), argnums=(0, 1, 2)))(q, k, v))

    seq_minor = "f32[2,2,32,256]"  # [batch, key/value heads, head width, sequence]
    assert program(SplashAttention(128, 128)).count(seq_minor) >= 2
    assert seq_minor not in program(SplashAttention(128, 128, seq_minor=""))
    assert "f32[2,4,32,256]" in program(SplashAttention(128, 128, seq_minor="qkv"))


def test_what_the_kernel_does_not_take_is_said():
    q, k, _ = _inputs(4, 2)
    kernel = SplashAttention(128, 128)
    assert kernel.supports(q, k, None, None, None)
    assert not kernel.supports(q, k, None, 64, None)  # a sliding window
    assert not kernel.supports(q, k, None, None, 30.0)  # soft-capped logits
    shared = SharedPrefixes(*(jnp.zeros((2, SEQ), jnp.int32) for _ in range(3)))
    assert not kernel.supports(q, k, shared, None, None)
    assert not kernel.supports(q[:, :200], k[:, :200], None, None, None)  # not whole blocks
    assert SplashAttention(512, 512).supports(q, k, None, None, None)  # one block: the sequence


def test_the_default_blocks_are_512_rows_up_to_1024_positions_and_1024_from_2048():
    kernel = SplashAttention()
    assert [kernel.blocks(seq) for seq in (256, 1024, 2048, 4096)] == [
        (256, 256), (512, 512), (1024, 1024), (1024, 1024)]
    assert kernel.blocks(2560) == (512, 512)  # not whole blocks of 1024: blocks of 512
    assert SplashAttention(256, 128).blocks(2048) == (256, 128)  # given blocks are kept
