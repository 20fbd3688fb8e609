"""The log-probability of each token of a text given the tokens before it, under a transformer:
one forward pass over rows whose sequences may share a prefix (``SharedPrefixes``), then the
head's log-probabilities a chunk of tokens at a time (``losses.head_token_logps``), never the
whole ``[tokens, vocab]`` logits at once.

Two layouts of text are scored so, each built by its own function as ``ScoredText``:

- ``pair_rows``: packed preference pairs (``data/pair_rows.py``), each pair's prompt once and
  both answers after it, scored by the preference loss and its reference column;
- ``rollout_rows``: a prompt's completions (GRPO's rollouts), several of them in one row where
  that costs less (``completions_per_row``), scored by the policy-gradient loss and for the
  old and the reference log-probabilities.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from trainrun.models.losses import head_token_logps
from trainrun.models.transformer import SharedPrefixes, Transformer

Batch = dict[str, Any]


class ScoredText(NamedTuple):
    """Rows a forward pass reads and the tokens it scores: ``inputs`` ``[rows, length]`` with
    their ``segments``; ``targets`` ``[scored rows, n]``, each slot's next token from slot
    ``scored_from`` of each row on (-1: not scored; the slots before it are a prefix the scored
    tokens share, whose own next tokens nothing reads)."""

    inputs: jax.Array
    segments: SharedPrefixes
    targets: jax.Array
    scored_from: int = 0


def token_logps(module: Transformer, text: ScoredText, key: jax.Array | None = None,
                chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """``(logps, entropy)``, each shaped as ``text.targets``, float32: each target's
    log-probability given the tokens its sequence holds before it (0 for a target of -1), and
    the entropy of the distribution it was drawn from (a measurement: no gradient). The head's
    logits ``chunk`` tokens at a time (``model.loss_chunk``; 0: all at once)."""
    features, _ = module.features(text.inputs, key, segments=text.segments,
                                  segment_positions=text.segments.position)
    if text.scored_from:
        rows, length = text.inputs.shape
        features = features.reshape(rows, length, -1)[:, text.scored_from:].reshape(
            -1, features.shape[-1])
    logps, entropy = head_token_logps(features, module.head_table(), text.targets.reshape(-1),
                                      chunk, module.final_softcap)
    return logps.reshape(text.targets.shape), entropy.reshape(text.targets.shape)


# ---- packed preference pairs -----------------------------------------------------------------

PAIR_ROW_ARRAYS = ("tokens", "segment_ids", "positions", "pair_slot", "branch")  # read here


def pair_rows(batch: Batch) -> ScoredText:
    """The pair rows in ``batch`` (``PAIR_ROW_ARRAYS``, ``[rows, row_len]``) as scored text:
    each slot's next token of its sequence (-1 where the next token starts another sequence or
    is padding), each branch seeing its pair's shared prefix; ``[rows, row_len - 1]``."""
    tokens = batch["tokens"]
    segments = batch["segment_ids"].astype(jnp.int32)
    prefixes = SharedPrefixes(*(batch[name][:, :-1].astype(jnp.int32)
                                for name in ("pair_slot", "branch", "positions")))
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    targets = jnp.where(same, tokens[:, 1:].astype(jnp.int32), -1)  # -1: not a target
    return ScoredText(tokens[:, :-1], prefixes, targets)


# ---- a prompt's completions ------------------------------------------------------------------

# A masked logit's mask, softmax and their gradients, in multiply-adds' time: elementwise work
# runs far below a matmul's rate (BENCHMARKS.md, "Reinforcement learning (GRPO)").
LOGIT_COST = 150


def rollout_rows(module: Transformer, tokens: jax.Array, start: jax.Array, limit: int,
                 group: int = 1) -> ScoredText:
    """The last ``limit`` tokens of each row of ``tokens`` ``[rows, width + limit]``
    (left-padded from ``start``) as scored text, ``[rows, limit]``: the padding is a document
    of its own, which nothing attends across, and each row's positions count from its start.

    group: how many consecutive rows hold one prompt's completions (the same prompt, the same
    start). Where it pays (``completions_per_row``), several of them go in one row of the
    forward pass: the prompt but its last token once, then each completion after that token,
    each attending to the prompt and to itself alone, so the prompt is computed once for them,
    not once per completion."""
    inputs = tokens[:, :-1].astype(jnp.int32)
    rows, length = inputs.shape
    width = length + 1 - limit  # the prompts' padded width
    per_row = completions_per_row(module, rows, group, width, limit)
    packed = rows // per_row
    lead = width - 1  # the prompt but its last slot: shared by a row's completions
    prefix_slots = jnp.arange(lead)[None]
    first = start[::per_row, None]  # [packed, 1]: a row's completions share their start
    tail = per_row * limit  # each completion: the prompt's last token, then its inputs
    inputs = jnp.concatenate([inputs[::per_row, :lead], inputs[:, lead:].reshape(packed, tail)],
                             axis=1)
    segments = SharedPrefixes(
        group=jnp.concatenate([(prefix_slots >= first).astype(jnp.int32),
                               jnp.ones((packed, tail), jnp.int32)], axis=1),
        branch=jnp.broadcast_to(jnp.concatenate([
            jnp.zeros(lead, jnp.int32), jnp.repeat(jnp.arange(1, per_row + 1), limit)]),
            inputs.shape),
        position=jnp.concatenate([jnp.maximum(prefix_slots - first, 0),
                                  lead - first + jnp.tile(jnp.arange(limit), per_row)[None]],
                                 axis=1))
    return ScoredText(inputs, segments, tokens[:, -limit:].astype(jnp.int32), scored_from=lead)


def completions_per_row(module: Transformer, rows: int, group: int, width: int,
                        limit: int) -> int:
    """How many of a prompt's completions ``rollout_rows`` puts in one row: the divisor of
    ``group`` and ``rows`` that costs the least, counting each token's multiply-adds through
    the layers and the head, and its attention to the keys before it (half a row on average;
    each key a product with the query and the value, and a masked logit), for which a row of
    more completions pays with longer rows."""
    vocab, d_model = module.head_table().shape
    layers, heads = module.layers, module.blocks["0"].attn.heads
    per_token = 12 * d_model * d_model * layers + vocab * d_model  # projections, MLP, head
    per_key = layers * (2 * d_model + LOGIT_COST * heads)

    def cost(per_row: int) -> float:
        length = width - 1 + per_row * limit
        return rows / per_row * length * (per_token + per_key * length / 2)

    return min((n for n in range(1, group + 1) if group % n == 0 and rows % n == 0), key=cost)
