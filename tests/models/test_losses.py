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


@pytest.mark.parametrize("chunk", [0, 7, 50])  # one, padded, whole
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_chunked_token_logps_and_their_gradients_equal_the_plain_form(chunk, softcap):
    from trainrun.models.losses import head_token_logps, softcapped

    features, table, targets = inputs(seed=1)
    targets = targets.at[3].set(-1)  # a token left out: 0, and no gradient
    weights = jnp.asarray(np.random.default_rng(2).standard_normal(TOKENS), jnp.float32)

    def plain_logps(f, t):
        logits = softcapped((f @ t.T).astype(jnp.float32), softcap)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return jnp.where(targets >= 0, picked, 0.0), entropy

    def weighted(fn):
        return jax.jit(jax.value_and_grad(lambda f, t: jnp.sum(weights * fn(f, t)[0]),
                                          argnums=(0, 1)))

    got_logps, got_entropy = head_token_logps(features, table, targets, chunk, softcap)
    want_logps, want_entropy = plain_logps(features, table)
    np.testing.assert_allclose(got_logps, want_logps, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_entropy, want_entropy, rtol=0, atol=1e-5)
    assert float(got_logps[3]) == 0.0 and float(jnp.min(want_logps)) < -3
    value, grads = weighted(lambda f, t: head_token_logps(f, t, targets, chunk, softcap))(
        features, table)
    want, want_grads = weighted(plain_logps)(features, table)
    assert abs(float(value) - float(want)) < 1e-4
    for got, ref in zip(grads, want_grads, strict=True):
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * scale)


def test_the_token_logps_of_the_whole_batch_never_exist_in_a_chunked_pass():
    from trainrun.models.losses import head_token_logps

    features, table, targets = inputs(jnp.bfloat16)

    def grads(chunk):
        return jax.grad(lambda f, t: jnp.sum(head_token_logps(f, t, targets, chunk)[0]),
                        argnums=(0, 1))

    assert largest_float32(grads(0), features, table) == TOKENS * VOCAB  # the control
    assert largest_float32(grads(10), features, table) == max(10 * VOCAB, VOCAB * D)


def test_first_max_index_is_argmax_with_ties_infinities_and_nans() -> None:
    from trainrun.models.losses import first_max_index

    rows = np.array([[1.0, 3.0, 3.0, 2.0], [-np.inf] * 4, [0.0, np.nan, 5.0, np.nan],
                     [np.inf, 1.0, np.inf, 0.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    drawn = np.asarray(jax.random.normal(jax.random.key(0), (64, 300)))
    for x in (rows, drawn, drawn.round(1)):
        np.testing.assert_array_equal(first_max_index(jnp.asarray(x)), np.argmax(x, -1))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 7])  # one, and a shorter last chunk
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_head_loss_on_its_unrolled_path_equals_the_scanned_one(chunk, softcap):
    """The same loss, accuracy and gradients (weights, soft-cap and a skipped target too)
    with the chunks one after another in straight-line code."""
    from trainrun.models.losses import HeadPath

    features, embedding, targets = inputs(seed=4)
    targets = targets.at[:6].set(jnp.argmax(features[:6] @ embedding.T, -1))  # some hits
    weights = jnp.arange(TOKENS) % 5 != 3
    path = HeadPath(unrolled=True)

    def loss_of(p):
        return jax.jit(jax.value_and_grad(lambda f, e: next_token_from_features(
            f, e, targets, chunk, weights=weights, softcap=softcap, path=p), argnums=(0, 1),
            has_aux=True))

    (loss, aux), grads = loss_of(path)(features, embedding)
    (want, want_aux), want_grads = loss_of(HeadPath())(features, embedding)
    assert path != HeadPath() and path.unrolls(-(-TOKENS // (chunk or TOKENS)))  # exercised
    assert float(want_aux["accuracy"]) > 0.05 and float(want) > 1.0
    assert abs(float(loss) - float(want)) < 1e-5
    assert float(aux["accuracy"]) == float(want_aux["accuracy"])
    assert float(aux["weight"]) == float(want_aux["weight"])
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_the_unrolled_head_holds_no_scan_and_no_more_logits_than_a_chunk():
    from trainrun.models.losses import HeadPath

    features, embedding, targets = inputs(jnp.bfloat16)

    def grads(path):
        return jax.grad(lambda f, e: next_token_from_features(f, e, targets, 10, path=path)[0],
                        argnums=(0, 1))

    unrolled = HeadPath(unrolled=True)
    primitives = {eqn.primitive.name for eqn in equations(grads(unrolled), features, embedding)}
    assert "scan" in {eqn.primitive.name for eqn in equations(grads(HeadPath()), features,
                                                              embedding)}
    assert "scan" not in primitives and "while" not in primitives
    assert largest_float32(grads(unrolled), features, embedding) == max(10 * VOCAB, VOCAB * D)


def test_past_its_most_chunks_the_unrolled_head_is_scanned_its_program_one_size():
    """Straight-line chunks grow the program, and its compile, with the batch: past
    ``most_unrolled`` chunks they are scanned, the program the same size at any count."""
    from trainrun.models.losses import HeadPath

    path = HeadPath(unrolled=True, most_unrolled=3)
    features, embedding, targets = inputs()

    def primitives(count):
        tokens = 5 * count  # chunks of 5 tokens
        first = targets[:tokens]
        return [eqn.primitive.name for eqn in equations(jax.grad(
            lambda f, e: next_token_from_features(f, e, first, 5, path=path)[0],
            argnums=(0, 1)), features[:tokens], embedding)]

    at_most, past, far_past = primitives(3), primitives(4), primitives(10)
    assert "scan" not in at_most and len(at_most) > len(primitives(2))  # unrolled: it grows
    assert "scan" in past and past == far_past
    assert path.unrolls(3) and not path.unrolls(4) and not HeadPath().unrolls(1)


@pytest.mark.slow
def test_the_unrolled_head_holds_one_chunks_logits_at_a_time_in_the_compiled_program():
    """XLA's own memory analysis: the unrolled chunks' temporaries are the scan's, not all
    the chunks' logits at once (each chunk waits until the one before is done with its own)."""
    from trainrun.models.losses import HeadPath

    tokens, width, vocab, chunk = 2048, 64, 4096, 256
    draw = np.random.default_rng(0)
    features = jnp.asarray(draw.standard_normal((tokens, width)), jnp.bfloat16)
    table = jnp.asarray(draw.standard_normal((vocab, width)) * 0.02, jnp.bfloat16)
    targets = jnp.asarray(draw.integers(0, vocab, tokens), jnp.int32)

    def temp_bytes(size, path):
        fn = jax.jit(jax.value_and_grad(lambda f, t: next_token_from_features(
            f, t, targets, size, path=path)[0], argnums=(0, 1)))
        return fn.lower(features, table).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = tokens * vocab * 4
    whole = temp_bytes(0, HeadPath())
    scanned, unrolled = temp_bytes(chunk, HeadPath()), temp_bytes(chunk, HeadPath(unrolled=True))
    assert whole > logits_bytes  # the control: one chunk of every token holds all the logits
    assert unrolled < 1.25 * scanned and unrolled < logits_bytes / 2, (unrolled, scanned)


def test_a_chunk_reads_its_logits_maximum_once_for_its_log_sum_exp_and_its_first_maximum():
    from trainrun.models.losses import HeadPath

    features, embedding, targets = inputs()

    def forward(path):
        return lambda f, e: next_token_from_features(f, e, targets, 10, path=path)[0]

    for path in (HeadPath(), HeadPath(unrolled=True)):
        maxima = [eqn for eqn in equations(forward(path), features, embedding)
                  if eqn.primitive.name == "reduce_max"]
        assert len(maxima) == (5 if path.unrolled else 1), maxima  # a chunk's (5 unrolled)


def test_the_log_sum_exp_from_a_given_maximum_is_jaxs_to_the_bit():
    from trainrun.models.losses import logsumexp_from_max

    rows = np.array([[1.0, 3.0, 3.0, 2.0], [-np.inf] * 4, [0.0, np.nan, 5.0, np.nan],
                     [np.inf, 1.0, np.inf, 0.0], [-0.0, 0.0, -1.0, -2.0]], np.float32)
    drawn = np.asarray(jax.random.normal(jax.random.key(0), (64, 3000))) * 30
    for x in (jnp.asarray(rows), jnp.asarray(drawn)):
        got = jax.jit(lambda x: logsumexp_from_max(x, jnp.max(x, axis=-1)))(x)
        want = jax.jit(lambda x: jax.nn.logsumexp(x, axis=-1))(x)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
