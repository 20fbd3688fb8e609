"""Losses shared by the models, computed in float32 whatever the compute dtype."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax

LN2 = math.log(2.0)


def first_max_index(x: jax.Array, top: jax.Array | None = None) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first greatest value's index, or the first NaN's) as
    int32, from two plain reductions: XLA:CPU runs argmax's one reduction of value and index
    pairs several times slower (BENCHMARKS.md, "Reinforcement learning (GRPO)"). ``top``:
    ``jnp.max(x, axis=-1)`` where the caller has it already."""
    top = jnp.max(x, axis=-1) if top is None else top
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where((x == top[..., None]) | jnp.isnan(x), index, x.shape[-1]), axis=-1)


def logsumexp_from_max(x: jax.Array, top: jax.Array) -> jax.Array:
    """``jax.nn.logsumexp(x, axis=-1)``, the same operations in the same order, from ``top =
    jnp.max(x, axis=-1)`` computed once by the caller (who reads ``x`` for more than this)."""
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(jnp.exp(x - shift[..., None]), axis=-1)
    return jnp.log(jnp.abs(total)) + shift


def mean_squared_error(predictions: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((predictions.astype(jnp.float32) - targets) ** 2)


def classification(logits: jax.Array,
                   labels: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy over every position of ``labels`` and the accuracy of the argmax."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = jnp.mean(first_max_index(logits) == labels)
    return loss, {"accuracy": accuracy}


def next_token(logits: jax.Array,
               tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Language-model loss of ``logits`` [B, T, V] against ``tokens`` [B, T] (the inputs shifted
    by one). Also bits per token; for byte tokens (uint8) that is bits per byte, the unit in
    which byte-level models are compared."""
    loss, aux = classification(logits, tokens.astype(jnp.int32))
    unit = "bits_per_byte" if tokens.dtype == jnp.uint8 else "bits_per_token"
    return loss, {**aux, unit: loss / LN2}


# ---- the output head and its loss, in chunks of tokens ----------------------------------------


@dataclasses.dataclass(frozen=True)
class HeadPath:
    """How the head's loss over chunks is computed (never what). ``unrolled``: the chunks one
    after another in straight-line code instead of a ``lax.scan``, each chunk's logits made
    only once the chunk before is done with its own (in the backward pass too), so one
    chunk's float32 logits are still all that exists of them at a time, up to
    ``most_unrolled`` chunks. The plain path is the default;
    ``fast/strategies.py`` chooses another once per run (docs/internals.md, "Fast paths")."""

    unrolled: bool = False
    # more chunks than this are scanned even so: straight-line code grows with the batch, and
    # its compile with it (BENCHMARKS.md, "Ninth run on the chip")
    most_unrolled: int = 16

    def unrolls(self, count: int) -> bool:
        """Whether ``count`` chunks run one after another in straight-line code."""
        return self.unrolled and count <= self.most_unrolled


PLAIN_HEAD = HeadPath()


def next_token_from_features(features: jax.Array, embedding: jax.Array, targets: jax.Array,
                             chunk: int = 0, unit: str = "bits_per_token",
                             weights: jax.Array | None = None, softcap: float | None = None,
                             path: HeadPath = PLAIN_HEAD,
                             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The language-model loss of a tied output head: ``logits = features @ embedding.T``, then
    mean cross-entropy against ``targets``, without ever holding the ``[tokens, vocab]`` logits
    of the whole batch.

    features: ``[tokens, d_model]`` in the compute dtype; embedding: ``[vocab, d_model]`` in the
        compute dtype; targets: ``[tokens]`` integer ids.
    chunk: tokens per chunk of logits (0: all at once). At GPT-2's vocabulary (50304) the logits
        of 32 x 1024 tokens are 50304 x 32768 float32 values; chunks of 4096 tokens hold an
        eighth of them at a time.
    weights: ``[tokens]`` booleans, the targets that count (packed rows: not padding, not across
        a document boundary). The loss is then the mean over those, and aux ``"weight"`` their
        number (``Model``); a target left out changes neither the loss nor any gradient.
    softcap: the logits become ``softcap * tanh(logits / softcap)`` before the cross-entropy
        (None: as they are), in the backward pass too.

    The head's matmuls take their operands in the compute dtype and accumulate in float32
    (``preferred_element_type``); the log-sum-exp, the loss and the logits' gradient are float32,
    the gradient is cast to the compute dtype before its two matmuls (as autodiff of a cast
    would). With more than one chunk the backward pass recomputes each chunk's logits instead
    of storing them. Same value and gradients as ``next_token`` on the full logits (tested).
    path: how the chunks are computed (``HeadPath``); the same loss and gradients on every
    path, to float rounding.
    """
    tokens = features.shape[0]
    chunk = tokens if chunk <= 0 else min(chunk, tokens)
    count = -(-tokens // chunk)
    targets = targets.astype(jnp.int32)
    if weights is not None:
        targets = jnp.where(weights, targets, -1)  # -1: a row the head's loss skips
    # custom_vjp's unannotated __new__ (JAX) loses the wrapped function's return type.
    if not path.unrolls(count):
        loss_sum, hits = _head_cross_entropy(  # pyright: ignore[reportGeneralTypeIssues]
            features, embedding, targets, chunk, count, softcap)
    else:
        loss_sum, hits = _head_cross_entropy_unrolled(  # pyright: ignore[reportGeneralTypeIssues]
            features, embedding, targets, chunk, softcap)
    if weights is None:
        loss = loss_sum / tokens
        return loss, {"accuracy": hits / tokens, unit: loss / LN2}
    counted = jnp.sum(weights, dtype=jnp.float32)
    loss = loss_sum / jnp.maximum(counted, 1.0)
    return loss, {"accuracy": hits / jnp.maximum(counted, 1.0), unit: loss / LN2,
                  "weight": counted}


def head_token_logps(features: jax.Array, table: jax.Array, targets: jax.Array,
                     chunk: int = 0, softcap: float | None = None,
                     ) -> tuple[jax.Array, jax.Array]:
    """Each token's ``log p(target)`` under the output head ``logits = features @ table.T``
    (soft-capped by ``softcap``), and the entropy of its distribution, each ``[tokens]``
    float32, without ever holding the ``[tokens, vocab]`` logits of more than ``chunk``
    tokens (0: all at once), as ``next_token_from_features`` computes the loss. A target of -1
    gives 0. The entropy is a measurement: no gradient flows through it. The backward pass of
    the log-probabilities recomputes each chunk's logits when there is more than one."""
    tokens = features.shape[0]
    chunk = tokens if chunk <= 0 else min(chunk, tokens)
    count = -(-tokens // chunk)
    # custom_vjp's unannotated __new__ (JAX) loses the wrapped function's return type.
    logps, entropy = _head_token_logps(  # pyright: ignore[reportGeneralTypeIssues]
        features, table, targets.astype(jnp.int32), chunk, count, softcap)
    return logps, jax.lax.stop_gradient(entropy)


def _chunk_logps(features: jax.Array, table: jax.Array, targets: jax.Array,
                 softcap: float | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One chunk's log-probabilities, entropies, log-sum-exps and logits."""
    lse, loss, _, logits = _chunk_forward(features, table, targets, softcap)
    entropy = lse - jnp.sum(jnp.exp(logits - lse[:, None]) * logits, axis=-1)
    return -loss, entropy, lse, logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _head_token_logps(features, table, targets, chunk, count, softcap=None):
    return _head_token_logps_fwd(features, table, targets, chunk, count, softcap)[0]


def _head_token_logps_fwd(features, table, targets, chunk, count, softcap=None):
    if count == 1:  # one chunk: keep its logits for the backward pass, as autodiff would
        logps, entropy, lse, logits = _chunk_logps(features, table, targets, softcap)
        return (logps, entropy), (features, table, targets, lse, logits)

    def body(_, part):
        logps, entropy, lse, _ = _chunk_logps(part[0], table, part[1], softcap)
        return None, (logps, entropy, lse)

    _, (logps, entropy, lse) = jax.lax.scan(body, None, (
        _chunks(features, chunk, count), _chunks(targets, chunk, count, fill=-1)))
    tokens = features.shape[0]
    return ((logps.reshape(-1)[:tokens], entropy.reshape(-1)[:tokens]),
            (features, table, targets, lse, None))


def _head_token_logps_bwd(chunk, count, softcap, residuals, cotangents):
    # d log p(target) / d logits = onehot - probs: the cross-entropy's gradient, negated
    features, table, targets, lse, logits = residuals
    scale = -cotangents[0].astype(jnp.float32)  # the entropy's is dropped (a measurement)
    return (*_head_backward(features, table, targets, lse, logits, scale, chunk, count,
                            softcap), None)


def _head_backward(features, table, targets, lse, logits, scale, chunk, count, softcap):
    """The gradients of a head's features and table from its logits' gradient ``(probs -
    onehot) * scale``: ``scale`` a scalar, or ``[tokens]`` each token's own. ``logits``: the
    one chunk's, kept by the forward pass; None: each of the ``count`` chunks' recomputed."""
    per_token = scale.ndim == 1
    if count == 1:
        d_features, d_table = _head_grads(features, table, targets, lse, logits,
                                          scale[:, None] if per_token else scale, softcap)
        return d_features, d_table.astype(table.dtype)
    parts = (_chunks(features, chunk, count), _chunks(targets, chunk, count, fill=-1), lse)

    def body(total, part):
        part_features, part_targets, part_lse = part[:3]
        part_logits = softcapped(tied_head_logits(part_features, table), softcap)
        d_features, d_table = _head_grads(part_features, table, part_targets, part_lse,
                                          part_logits, part[3] if per_token else scale, softcap)
        return total + d_table, d_features

    d_table, d_features = jax.lax.scan(
        body, jnp.zeros(table.shape, jnp.float32),
        (*parts, _chunks(scale, chunk, count)[..., None]) if per_token else parts)
    d_features = d_features.reshape(-1, features.shape[-1])[:features.shape[0]]
    return d_features, d_table.astype(table.dtype)


def _head_grads(features, table, targets, lse, logits, scale, softcap):
    """The gradients of one chunk's features (in their dtype) and of the head's table
    (float32), from its logits' gradient ``(probs - onehot) * scale`` (through the cap where
    there is one)."""
    dot = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)
    d_logits = _chunk_logits_grad(logits, lse, targets, scale)
    if softcap is not None:  # through the cap: d tanh(u) = 1 - tanh(u)^2
        d_logits = d_logits * (1.0 - jnp.square(logits / jnp.float32(softcap)))
    d_logits = d_logits.astype(features.dtype)
    d_features = dot(d_logits, table, (((1,), (0,)), ((), ())))
    d_table = dot(d_logits, features, (((0,), (0,)), ((), ())))
    return d_features.astype(features.dtype), d_table


_head_token_logps.defvjp(_head_token_logps_fwd, _head_token_logps_bwd)


def tied_head_logits(features: jax.Array, embedding: jax.Array) -> jax.Array:
    """``features @ embedding.T`` with float32 accumulation and output: a tied output head's
    logits (operands in the compute dtype)."""
    return jax.lax.dot_general(features, embedding, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def _chunks(x: jax.Array, chunk: int, count: int, fill: int | float = 0) -> jax.Array:
    """``x`` ``[tokens, ...]`` padded to ``count * chunk`` rows, as ``[count, chunk, ...]``."""
    pad = count * chunk - x.shape[0]
    if pad:
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
    return x.reshape(count, chunk, *x.shape[1:])


def softcapped(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(logits / cap)``: logits squashed into ``(-cap, cap)`` (attention's or the
    output head's); as they are where ``cap`` is None."""
    if cap is None:
        return logits
    return jnp.tanh(logits / jnp.asarray(cap, logits.dtype)) * jnp.asarray(cap, logits.dtype)


def _chunk_forward(features: jax.Array, embedding: jax.Array, targets: jax.Array,
                   softcap: float | None = None):
    """Per token of one chunk: log-sum-exp, loss, whether the argmax is the target; and the
    chunk's logits (soft-capped by ``softcap`` where given). Padded rows (target -1) have loss
    and hit 0."""
    logits = softcapped(tied_head_logits(features, embedding), softcap)
    # one maximum for both: the logits are [chunk, vocab] float32, each pass over them costs
    top = jnp.max(logits, axis=-1)
    lse = logsumexp_from_max(logits, top)
    valid = targets >= 0
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
    loss = jnp.where(valid, lse - picked, 0.0)
    hit = jnp.where(valid, first_max_index(logits, top) == targets, False)
    return lse, loss, hit, logits


def _chunk_logits_grad(logits: jax.Array, lse: jax.Array, targets: jax.Array,
                       scale: jax.Array) -> jax.Array:
    """d(loss_sum)/d(logits) of one chunk, times the incoming cotangent ``scale``."""
    probs = jnp.exp(logits - lse[:, None])
    onehot = jnp.arange(logits.shape[-1])[None, :] == targets[:, None]
    grad = probs - onehot.astype(jnp.float32)
    return jnp.where((targets >= 0)[:, None], grad, 0.0) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _head_cross_entropy(features, embedding, targets, chunk, count, softcap=None):
    return _head_cross_entropy_fwd(features, embedding, targets, chunk, count, softcap)[0]


def _head_cross_entropy_fwd(features, embedding, targets, chunk, count, softcap=None):
    if count == 1:  # one chunk: keep its logits for the backward pass, as autodiff would
        lse, loss, hit, logits = _chunk_forward(features, embedding, targets, softcap)
        out = (jnp.sum(loss), jnp.sum(hit.astype(jnp.float32)))
        return out, (features, embedding, targets, lse, logits)

    def body(carry, part):
        lse, loss, hit, _ = _chunk_forward(part[0], embedding, part[1], softcap)
        return (carry[0] + jnp.sum(loss), carry[1] + jnp.sum(hit.astype(jnp.float32))), lse

    zero = jnp.zeros((), jnp.float32)
    out, lse = jax.lax.scan(body, (zero, zero), (_chunks(features, chunk, count),
                                                 _chunks(targets, chunk, count, fill=-1)))
    return out, (features, embedding, targets, lse, None)


def _head_cross_entropy_bwd(chunk, count, softcap, residuals, cotangents):
    features, embedding, targets, lse, logits = residuals
    scale = cotangents[0].astype(jnp.float32)  # the hit count has no gradient
    return (*_head_backward(features, embedding, targets, lse, logits, scale, chunk, count,
                            softcap), None)


_head_cross_entropy.defvjp(_head_cross_entropy_fwd, _head_cross_entropy_bwd)


# ---- the same loss on another path (HeadPath): the chunks unrolled ------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _head_cross_entropy_unrolled(features, embedding, targets, chunk, softcap):
    return _unrolled_fwd(features, embedding, targets, chunk, softcap)[0]


def _unrolled_fwd(features, embedding, targets, chunk, softcap):
    parts: list[tuple[jax.Array, jax.Array, jax.Array]] = []
    done = None
    for lo, hi in _spans(features.shape[0], chunk):
        part = _chunk_forward(_rows_after(features, lo, hi, done), embedding, targets[lo:hi],
                              softcap)[:3]
        parts.append(part)
        done = (jnp.sum(part[2].astype(jnp.int32)), jnp.sum(part[1]))
    lse, loss, hit = (jnp.concatenate(column) for column in zip(*parts, strict=True))
    out = (jnp.sum(loss), jnp.sum(hit.astype(jnp.float32)))
    return out, (features, embedding, targets, lse)


def _unrolled_bwd(chunk, softcap, residuals, cotangents):
    features, embedding, targets, lse = residuals
    scale = cotangents[0].astype(jnp.float32)  # the hit count has no gradient
    d_features: list[jax.Array] = []
    d_table: jax.Array | None = None
    done: tuple[jax.Array, ...] = (jnp.sum(lse),)  # the first chunk's, not during the forward
    for lo, hi in _spans(features.shape[0], chunk):
        part_features = _rows_after(features, lo, hi, done)
        logits = softcapped(tied_head_logits(part_features, embedding), softcap)
        d_part_features, d_part_table = _head_grads(part_features, embedding, targets[lo:hi],
                                                    lse[lo:hi], logits, scale, softcap)
        d_features.append(d_part_features)
        d_table = d_part_table if d_table is None else d_table + d_part_table
        # the running sum, not this chunk's part: else every part may wait for one late sum
        done = (jnp.sum(d_table[0]), jnp.sum(d_part_features[0], dtype=jnp.float32))
    assert d_table is not None  # a head has at least one token
    return jnp.concatenate(d_features), d_table.astype(embedding.dtype), None


_head_cross_entropy_unrolled.defvjp(_unrolled_fwd, _unrolled_bwd)


def _rows_after(features: jax.Array, lo: int, hi: int, done: tuple[jax.Array, ...] | None
                ) -> jax.Array:
    """``features[lo:hi]``, read only once ``done`` (values of the chunk before that need
    all of its logits) is computed: XLA then makes one chunk's logits after the last one's
    are used, not several chunks' at once. An offset of 0 the compiler cannot prove 0 makes
    the dependency (an ``optimization_barrier`` is dropped before scheduling on XLA:CPU)."""
    if done is None:
        return features[lo:hi]
    # each comparison is 0 or 1, so their sum is never below 0
    zero = jnp.minimum(sum((x != x).astype(jnp.int32) if jnp.issubdtype(x.dtype, jnp.floating)
                           else (x < 0).astype(jnp.int32) for x in done), 0)
    return jax.lax.dynamic_slice_in_dim(features, lo + zero, hi - lo)


def _spans(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` token ranges of the chunks (0: one); the last may be shorter."""
    chunk = tokens if chunk <= 0 else min(chunk, tokens)
    return [(lo, min(lo + chunk, tokens)) for lo in range(0, tokens, chunk)]
