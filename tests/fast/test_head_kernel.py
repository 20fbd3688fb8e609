"""The fused forward kernel of the head's loss (interpreted on CPU) computes what the chunks
compute: log-sum-exps, losses and hits, with a padded last vocabulary block, ties, skipped
targets and a soft-cap; in the loss, the same value and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.fast.head_kernel import FusedHeadForward
from trainrun.models.losses import HeadPath, _chunk_forward, next_token_from_features

TOKENS, D, VOCAB = 256, 128, 700  # the vocabulary is not a whole number of blocks
KERNEL = FusedHeadForward(block_tokens=128, block_vocab=256)


def inputs(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    draw = np.random.default_rng(seed)
    features = jnp.asarray(draw.standard_normal((TOKENS, D)), jnp.float32)
    table = jnp.asarray(draw.standard_normal((VOCAB, D)) * 0.2, jnp.float32)
    table = table.at[600:650].set(table[:50])  # tied greatest logits across blocks
    targets = jnp.asarray(draw.integers(0, VOCAB, TOKENS), jnp.int32)
    best = jnp.argmax(features @ table.T, -1)
    targets = targets.at[::3].set(best[::3]).at[5].set(-1)  # hits, and a skipped target
    return features, table, targets


@pytest.mark.slow  # the kernel runs in Pallas' interpreter
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_the_kernel_gives_each_tokens_lse_loss_and_hit(softcap):
    features, table, targets = inputs()
    lse, loss, hit = KERNEL(features, table, targets, softcap)
    want_lse, want_loss, want_hit, _ = _chunk_forward(features, table, targets, softcap)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=2e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(hit, want_hit)
    assert int(jnp.sum(want_hit)) > TOKENS // 4 and float(loss[5]) == 0.0


@pytest.mark.slow
def test_the_loss_with_the_kernel_has_the_plain_paths_value_and_gradients():
    features, table, targets = inputs(1)
    weights = jnp.arange(TOKENS) % 7 != 2

    def loss_of(path):
        return jax.jit(jax.value_and_grad(lambda f, t: next_token_from_features(
            f, t, targets, 100, weights=weights, path=path), argnums=(0, 1), has_aux=True))

    (loss, aux), grads = loss_of(HeadPath(unrolled=True, forward=KERNEL))(features, table)
    (want, want_aux), want_grads = loss_of(HeadPath())(features, table)
    assert abs(float(loss) - float(want)) < 1e-5
    assert float(aux["accuracy"]) == float(want_aux["accuracy"]) > 0.2
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_the_program_holds_the_kernel_and_no_logits_in_its_forward_pass():
    features, table, targets = inputs()
    path = HeadPath(unrolled=True, forward=KERNEL)
    forward = jax.make_jaxpr(lambda f, t: next_token_from_features(f, t, targets, 100,
                                                                   path=path)[0])(features, table)
    text = str(forward)
    assert "pallas_call" in text
    assert f"f32[{TOKENS},{VOCAB}]" not in text and f"f32[100,{VOCAB}]" not in text


def test_what_the_kernel_takes_is_said():
    assert KERNEL.supports(TOKENS, VOCAB, D)
    assert not KERNEL.supports(TOKENS + 3, VOCAB, D)  # tokens in whole blocks
    assert not KERNEL.supports(TOKENS, VOCAB, 96)  # a lane-wide model width
    assert not FusedHeadForward(block_vocab=200).supports(TOKENS, VOCAB, D)
