"""The chunked output head and loss: the plain loss's value and gradients, without the whole
batch's logits in the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import TransformerModel
from trainrun.models import build_model
from trainrun.models.losses import next_token, next_token_from_features
from trainrun.program.precision import equations

TOKENS, D, VOCAB = 50, 16, 97


def inputs(dtype=jnp.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    features = jnp.asarray(rng.standard_normal((TOKENS, D)), dtype)
    embedding = jnp.asarray(rng.standard_normal((VOCAB, D)) * 0.5, dtype)
    targets = jnp.asarray(rng.integers(0, VOCAB, TOKENS), jnp.int32)
    return features, embedding, targets


def plain(features, embedding, targets):
    logits = (features @ embedding.T).astype(jnp.float32)
    return next_token(logits[None], targets[None])


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 7, 10, 50, 64])  # one, padded, exact, whole, larger
def test_chunked_head_and_loss_equal_the_plain_form(chunk):
    features, embedding, targets = inputs()

    def loss_of(fn):
        return jax.jit(jax.value_and_grad(lambda f, e: fn(f, e)[0], argnums=(0, 1)))

    loss, (d_features, d_embedding) = loss_of(
        lambda f, e: next_token_from_features(f, e, targets, chunk))(features, embedding)
    want, (want_features, want_embedding) = loss_of(
        lambda f, e: plain(f, e, targets))(features, embedding)
    assert float(want) > 1.0
    assert abs(float(loss) - float(want)) < 1e-5
    for got, ref in ((d_features, want_features), (d_embedding, want_embedding)):
        scale = float(jnp.max(jnp.abs(ref)))
        assert scale > 0
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * scale)
    _, aux = next_token_from_features(features, embedding, targets, chunk)
    _, want_aux = plain(features, embedding, targets)
    assert float(aux["accuracy"]) == float(want_aux["accuracy"])
    assert abs(float(aux["bits_per_token"]) - float(want_aux["bits_per_token"])) < 1e-5


def largest_float32(fn, *args) -> int:
    """The element count of the largest float32 value anywhere in ``fn``'s jaxpr."""
    return max((int(np.prod(var.aval.shape)) for eqn in equations(fn, *args)
                for var in eqn.outvars if getattr(var.aval, "dtype", None) == jnp.float32),
               default=0)


def test_the_whole_batchs_logits_never_exist_in_the_chunked_step():
    features, embedding, targets = inputs(jnp.bfloat16)

    def grads(chunk):
        return jax.grad(lambda f, e: next_token_from_features(f, e, targets, chunk)[0],
                        argnums=(0, 1))

    whole = largest_float32(grads(0), features, embedding)
    chunked = largest_float32(grads(10), features, embedding)
    assert whole == TOKENS * VOCAB  # the control: one chunk holds every token's logits
    # a chunk's logits, or the embedding gradient's float32 accumulator [vocab, d]
    assert chunked == max(10 * VOCAB, VOCAB * D) < TOKENS * VOCAB


@pytest.mark.slow
def test_the_transformer_loss_chunks_by_its_config_and_keeps_its_value():
    cfg = TransformerModel(d_model=32, layers=1, heads=2, seq_len=24, vocab=300, loss_chunk=0)
    chunked_cfg = cfg.model_copy(update={"loss_chunk": 20})  # 3 x 24 tokens: 4 chunks
    params = build_model(cfg).init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 300, (3, 25)).astype(np.int32)

    def run(c):
        model = build_model(c)
        fn = jax.value_and_grad(lambda p: model.loss(p, {"tokens": tokens}, jax.random.key(0))[0])
        return jax.jit(fn)(params), largest_float32(fn, params)

    (loss, grads), whole = run(cfg)
    (chunked_loss, chunked_grads), in_chunks = run(chunked_cfg)
    assert whole >= 3 * 24 * 300 > in_chunks
    assert abs(float(loss) - float(chunked_loss)) < 1e-5
    for got, ref in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * float(jnp.max(jnp.abs(ref))))
