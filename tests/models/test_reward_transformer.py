"""The reward model over packed pair rows: each answer's reward is what its prompt and answer
score alone, read at their last token that is not the pad token; the loss is Bradley-Terry with
the rows' margins and the centring term; accumulated microbatches give the whole batch's
gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import RewardModelConfig, TransformerModel
from trainrun.data.pair_rows import MARGIN, pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.models.reward_losses import RewardLoss
from trainrun.models.reward_transformer import (
    SCORE,
    body_config,
    body_params,
    make_reward_model,
    make_reward_transformer,
    pair_rewards,
    read_positions,
    sequence_rewards,
)
from trainrun.models.transformer import bind_transformer
from trainrun.program.step import make_gradient_fn

TINY = TransformerModel(d_model=32, layers=1, heads=2, seq_len=48, vocab=64, dropout=0.0,
                        tie_embeddings=False, pad_id=3)
PAD = 3


def _pairs(count: int, seed: int) -> list[Pair]:
    """Random pairs; some answers end in the pad token, one answer is pad tokens alone."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        prompt, chosen, rejected = (rng.integers(4, 64, n).astype(np.uint32)
                                    for n in (rng.integers(1, 6), rng.integers(1, 5),
                                              rng.integers(1, 5)))
        if i % 3 == 1:
            chosen = np.concatenate([chosen, [PAD, PAD]]).astype(np.uint32)
        pairs.append(Pair(prompt, chosen, rejected, margin=float(rng.normal())))
    pairs.append(Pair(np.asarray([PAD], np.uint32), np.asarray([PAD, PAD], np.uint32),
                      np.asarray([9], np.uint32), margin=0.0))
    return pairs


def _alone(params, pairs: list[Pair]) -> np.ndarray:
    """``[pairs, 2]``: each sequence's reward, each scored in a row of its own."""
    sequences = [np.concatenate([p.prompt, answer]) for p in pairs
                 for answer in (p.chosen, p.rejected)]
    width = max(s.size for s in sequences)
    tokens = np.zeros((len(sequences), width), np.int32)
    for row, ids in enumerate(sequences):
        tokens[row, :ids.size] = ids
    lengths = np.asarray([s.size for s in sequences], np.int32)
    bind = bind_transformer(body_config(TINY))
    scores = jax.jit(lambda p, t, n: sequence_rewards(bind(body_params(p)), p[SCORE], t, n, PAD))
    return np.asarray(scores(params, jnp.asarray(tokens), jnp.asarray(lengths))).reshape(-1, 2)


def test_each_packed_answer_scores_what_it_scores_alone() -> None:
    model = make_reward_transformer(TINY, RewardLoss())
    params = jax.jit(model.init)(jax.random.key(0))
    assert "head" not in params and params[SCORE].shape == (1, TINY.d_model)
    pairs = _pairs(8, 0)
    rows, _ = pack_pairs(pairs, 49, bins=4)
    assert rows["tokens"].shape[0] < len(pairs)  # several pairs share a row
    read, present = read_positions(rows, PAD)
    rewards = np.asarray(jax.jit(lambda p: pair_rewards(
        bind_transformer(body_config(TINY))(body_params(p)), p[SCORE], rows, read))(params))
    # pair r * slots + s - 1 is slot s of row r, the pairs of a row in their order
    slots = rows["tokens"].shape[1] // 2
    order = [row * slots + slot - 1 for row in range(rows["tokens"].shape[0])
             for slot in range(1, int(rows["pair_slot"][row].max()) + 1)]
    assert int(np.asarray(present).sum()) == len(order) == len(pairs)
    placed = rewards[order]
    # first fit keeps a row's pairs in the order they came; rows fill in turn
    packed = [pairs[i] for i in _first_fit_order(pairs, 49)]
    np.testing.assert_allclose(placed, _alone(params, packed), atol=2e-6)


def _first_fit_order(pairs: list[Pair], row_len: int) -> list[int]:
    from trainrun.data.documents import first_fit
    from trainrun.data.pair_rows import pair_length

    return [i for members in first_fit([pair_length(p) for p in pairs], row_len, 4)
            for i in members]


def test_the_score_is_read_at_the_last_token_that_is_not_the_pad_token() -> None:
    pair = Pair(np.asarray([5, 6], np.uint32), np.asarray([7, PAD, 8, PAD, PAD], np.uint32),
                np.asarray([PAD, PAD], np.uint32))
    rows, _ = pack_pairs([pair], 16, bins=1)
    read, present = read_positions(rows, PAD)
    # the row: 5 | 6 7 PAD 8 PAD PAD | 6 PAD PAD; chosen reads at 8, rejected at the prompt's 6
    assert np.asarray(read)[0].tolist() == [4, 7] and bool(present[0])
    read, _ = read_positions(rows, None)  # no pad token: each sequence's last token
    assert np.asarray(read)[0].tolist() == [6, 9]
    alone = Pair(np.asarray([PAD], np.uint32), np.asarray([PAD], np.uint32),
                 np.asarray([9], np.uint32))
    rows, _ = pack_pairs([alone], 8, bins=1)
    # the row: | PAD PAD | PAD 9; the chosen sequence is pad tokens alone: read at its first
    # token, as transformers' argmax of no non-pad token gives
    assert np.asarray(read_positions(rows, PAD)[0])[0].tolist() == [0, 3]


@pytest.mark.slow
def test_the_loss_is_bradley_terry_with_margins_and_centring() -> None:
    pairs = _pairs(6, 1)
    rows, _ = pack_pairs(pairs, 49, bins=4)
    assert MARGIN in rows
    coefficient = 0.3
    model = make_reward_transformer(TINY, RewardLoss(coefficient))
    params = jax.jit(model.init)(jax.random.key(1))
    params = {**params, SCORE: params[SCORE] * 50}  # rewards far apart: each term counts
    loss, aux, _ = jax.jit(lambda p: model.loss(p, rows, jax.random.key(0)))(params)
    ordered = [pairs[i] for i in _first_fit_order(pairs, 49)]
    rewards = _alone(params, ordered).astype(np.float64)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    margins = np.asarray([p.margin for p in ordered])
    want = (np.mean(np.log1p(np.exp(-(chosen - rejected - margins))))
            + coefficient * np.mean((chosen + rejected) ** 2))
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(aux["accuracy"]) == pytest.approx(np.mean(chosen > rejected))
    assert 0 < float(aux["accuracy"]) < 1
    assert float(aux["margin"]) == pytest.approx(np.mean(chosen - rejected), rel=1e-5)
    assert float(aux["min_reward"]) == pytest.approx(rewards.min(), rel=1e-5)
    assert float(aux["max_reward"]) == pytest.approx(rewards.max(), rel=1e-5)
    without = {k: v for k, v in rows.items() if k != MARGIN}
    plain, _, _ = jax.jit(lambda p: model.loss(p, without, jax.random.key(0)))(params)
    assert float(plain) != pytest.approx(float(loss))  # the margins reached the loss


@pytest.mark.slow
def test_accumulated_microbatches_give_the_full_batch_gradient() -> None:
    from trainrun.program.precision import Policy

    model = make_reward_model(TINY, RewardModelConfig(center_rewards_coefficient=0.01))
    params = jax.jit(model.init)(jax.random.key(2))
    rows, _ = pack_pairs(_pairs(12, 2), 33, bins=4)
    rows = {name: column[:4] for name, column in rows.items()}
    assert len({int(row.max()) for row in rows["pair_slot"]}) > 1  # pairs per row differ
    whole = jax.jit(make_gradient_fn(model, Policy()))
    split = jax.jit(make_gradient_fn(model, Policy(), accumulate=2))
    loss_a, aux_a, grads_a, _ = whole(params, rows, jax.random.key(0), None)
    loss_b, aux_b, grads_b, _ = split(params, rows, jax.random.key(0), None)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5)
    np.testing.assert_allclose(float(aux_a["accuracy"]), float(aux_b["accuracy"]), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grads_a, grads_b)
