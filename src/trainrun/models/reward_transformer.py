"""The reward model: the transformer with a scalar score head in place of its output head, as
transformers' ``...ForSequenceClassification`` with one label, trained on preference pairs with
the Bradley-Terry loss (``reward_losses.py``). It is a ``Model``, so the one training step
(``program/step.py``) runs it with everything it promises.

The params are the transformer's without an output head (``body_config``), and ``score``,
``[1, d_model]`` as transformers stores ``score.weight``. A sequence's reward is ``score``
times the final norm's output at its last token whose id is not ``model.pad_id`` (its first
token where every one is): the token transformers' ``ForSequenceClassification`` reads, its
``pad_token_id`` being ``model.pad_id``. With no pad id it is the sequence's last token.

Pairs come as preference tuning packs them (``data/pair_rows.py``): a pair's prompt once, then
its chosen and its rejected answer, each branch attending to the prompt and itself, so each
sequence computes what it computes alone. Each pair's two rewards are read off one forward
pass over the rows. Where the rows carry a ``margin`` column (float32 bits as int32, on every
token of a pair), it is each pair's margin in the loss.

Aux ``weight`` is the batch's pairs (logged as ``pairs``), so accumulated microbatches give the
full batch's mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.config import RewardModelConfig, TransformerModel
from trainrun.data.pair_rows import CHOSEN, MARGIN, REJECTED
from trainrun.models.adapters import Model
from trainrun.models.matmul import float32_dot
from trainrun.models.reward_losses import RewardLoss
from trainrun.models.transformer import (
    SharedPrefixes,
    Transformer,
    bind_transformer,
    make_transformer,
)

PyTree = Any
Batch = dict[str, jax.Array]
SCORE = "score"  # the score head's param
SCORE_STREAM = 0x53636F72  # "Scor": the score head's draw, folded off the init key


def body_config(cfg: TransformerModel) -> TransformerModel:
    """The transformer under the score head: ``cfg`` without an output head of its own (the
    score head reads the final norm's output; nothing multiplies it by a vocabulary)."""
    return cfg.model_copy(update={"tie_embeddings": True})


def score_init(key: jax.Array, cfg: TransformerModel) -> jax.Array:
    """A fresh score head, ``[1, d_model]``: normal with ``init_std`` (transformers draws its
    ``score`` as every ``Linear``, with ``initializer_range``), off its own stream of ``key``."""
    draw = jax.random.normal(jax.random.fold_in(key, SCORE_STREAM), (1, cfg.d_model))
    return draw * jnp.float32(cfg.init_std)


def body_params(params: PyTree) -> PyTree:
    """The transformer's params of a reward model's ``params`` (all but the score head)."""
    return {name: value for name, value in params.items() if name != SCORE}


def read_positions(batch: Batch, pad_id: int | None) -> tuple[jax.Array, jax.Array]:
    """``[pairs, 2]``: the flat index (row * row_len + column) of the token each pair's chosen
    and rejected sequence is read at (module docstring), and which of the ``[pairs]`` slots
    hold a pair; pair ``r * slots + s - 1`` is slot ``s`` of row ``r``, ``slots = row_len //
    2`` (a pair takes at least two tokens)."""
    tokens = batch["tokens"]
    rows, row_len = tokens.shape
    slots = row_len // 2
    slot = batch["pair_slot"].astype(jnp.int32)
    branch = batch["branch"].astype(jnp.int32)
    held = slot > 0
    readable = held if pad_id is None else held & (tokens.astype(jnp.int32) != pad_id)
    column = jnp.arange(rows * row_len, dtype=jnp.int32).reshape(rows, row_len)
    pair = jnp.arange(rows, dtype=jnp.int32)[:, None] * slots + jnp.maximum(slot, 1) - 1
    count = rows * slots
    sides = []
    for side in (CHOSEN, REJECTED):
        mine = held & ((branch == 0) | (branch == side))
        index = jnp.where(mine, pair, count).reshape(-1)
        last = jax.ops.segment_max(jnp.where(mine & readable, column, -1).reshape(-1), index,
                                   count + 1)[:count]
        first = jax.ops.segment_min(jnp.where(mine, column, rows * row_len).reshape(-1), index,
                                    count + 1)[:count]
        sides.append(jnp.where(last >= 0, last, first))
    present = jax.ops.segment_sum(held.reshape(-1).astype(jnp.int32),
                                  jnp.where(held, pair, count).reshape(-1), count + 1)[:count] > 0
    read = jnp.stack(sides, axis=-1)
    return jnp.where(present[:, None], read, 0), present


def pair_rewards(module: Transformer, score: jax.Array, batch: Batch, read: jax.Array,
                 key: jax.Array | None = None) -> jax.Array:
    """``[pairs, 2]`` float32 rewards (chosen, rejected) of the pair rows in ``batch``, each
    read at its token of ``read`` (``read_positions``); ``key``: dropout (None: none)."""
    tokens = batch["tokens"]
    positions = batch["positions"].astype(jnp.int32)
    prefixes = SharedPrefixes(batch["pair_slot"].astype(jnp.int32),
                              batch["branch"].astype(jnp.int32), positions)
    features, _ = module.features(tokens, key, segments=prefixes, segment_positions=positions)
    hidden = jnp.take(features, read.reshape(-1), axis=0)  # [pairs * 2, d_model]
    rewards = float32_dot(hidden, score.astype(hidden.dtype), (((1,), (1,)), ((), ())))
    return rewards.reshape(read.shape)


def pair_margins(batch: Batch, read: jax.Array) -> jax.Array | None:
    """Each pair's margin from the rows' ``margin`` column, read at its chosen sequence's
    token (None: the rows carry none)."""
    if MARGIN not in batch:
        return None
    column = jax.lax.bitcast_convert_type(batch[MARGIN].astype(jnp.int32), jnp.float32)
    return jnp.take(column.reshape(-1), read[:, 0])


def sequence_rewards(module: Transformer, score: jax.Array, tokens: jax.Array,
                     lengths: jax.Array, pad_id: int | None) -> jax.Array:
    """``[batch]`` float32 rewards of whole sequences, one a row, ``tokens`` ``[batch, len]``
    right-padded after each row's ``lengths`` tokens: each read as in pair rows (its last
    token that is not ``pad_id``, within its length)."""
    rows, width = tokens.shape
    columns = jnp.arange(width, dtype=jnp.int32)[None]
    inside = columns < lengths[:, None]
    readable = inside if pad_id is None else inside & (tokens.astype(jnp.int32) != pad_id)
    read = jnp.max(jnp.where(readable, columns, 0), axis=1)
    features, _ = module.features(tokens, None)
    hidden = jnp.take(features, jnp.arange(rows) * width + read, axis=0)
    return float32_dot(hidden, score.astype(hidden.dtype), (((1,), (1,)), ((), ())))[:, 0]


def make_reward_transformer(cfg: TransformerModel, loss: RewardLoss) -> Model:
    """The reward model of the transformer ``cfg`` describes, its loss ``loss`` over pair
    rows."""
    body = body_config(cfg)
    base = make_transformer(body)
    bind = bind_transformer(body)

    def init(key: jax.Array) -> PyTree:
        return {**base.init(key), SCORE: score_init(key, cfg)}

    def evaluate(params: PyTree, batch: Batch,
                 key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        read, present = read_positions(batch, cfg.pad_id)
        rewards = pair_rewards(bind(body_params(params)), params[SCORE], batch, read, key)
        value, aux = loss(rewards[:, 0], rewards[:, 1], present, pair_margins(batch, read))
        return value, {**aux, "weight": jnp.sum(present, dtype=jnp.float32)}

    def train_loss(params: PyTree, batch: Batch, key: jax.Array,
                   model_state: PyTree = None) -> tuple[jax.Array, dict[str, jax.Array], PyTree]:
        value, aux = evaluate(params, batch, key)
        return value, aux, model_state

    def eval_loss(params: PyTree, batch: Batch,
                  model_state: PyTree = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        return evaluate(params, batch, None)

    axes = base.logical_axes
    return dataclasses.replace(
        base, init=init, loss=train_loss, eval_loss=eval_loss, name="transformer (reward)",
        logical_axes=None if axes is None else {**axes, SCORE: (None, "embed")},
        weight_name="pairs")


def make_reward_model(cfg: TransformerModel, section: RewardModelConfig) -> Model:
    """The reward model of a run's ``model`` and ``reward_model`` sections."""
    return make_reward_transformer(cfg, RewardLoss(section.center_rewards_coefficient))
