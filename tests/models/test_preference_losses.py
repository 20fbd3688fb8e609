"""Preference losses against their published formulas, computed here in float64 NumPy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.models.preference_losses import PairLogps, PreferenceLoss


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


# The DPO test vector of the public implementations: per-pair losses at beta 0.1.
POLICY = PairLogps(jnp.array([-0.5, -10.0, -1.0]), jnp.array([-0.1, -30.0, -21.0]),
                   jnp.array([2.0, 5.0, 4.0]), jnp.array([1.0, 7.0, 9.0]))
REFERENCE = PairLogps(jnp.array([-0.5, -10.1, -0.1]), jnp.array([-0.1, -20.1, -0.1]),
                      POLICY.chosen_tokens, POLICY.rejected_tokens)


def _per_pair(spec: PreferenceLoss) -> np.ndarray:
    """Each pair's loss alone: the mean over a batch of one."""
    out = []
    for i in range(3):
        one = PairLogps(*(x[i:i + 1] for x in POLICY))
        ref = PairLogps(*(x[i:i + 1] for x in REFERENCE))
        out.append(float(spec(one, ref if spec.needs_reference else None)[0]))
    return np.array(out)


def test_dpo_matches_the_published_test_vector() -> None:
    np.testing.assert_allclose(_per_pair(PreferenceLoss("sigmoid", beta=0.1)),
                               [0.693147, 0.313262, 0.126928], atol=1e-6)


def _numpy_inputs() -> tuple[np.ndarray, ...]:
    p = [np.asarray(x, np.float64) for x in POLICY]
    r = [np.asarray(x, np.float64) for x in REFERENCE]
    return (*p, *r)


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.1)])
def test_losses_with_a_reference_equal_their_formulas(beta: float, ls: float) -> None:
    pc, pr, nc, nr, rc, rr, _, _ = _numpy_inputs()
    delta = (pc - pr) - (rc - rr)
    expected = {
        "sigmoid": -(1 - ls) * _log_sigmoid(beta * delta) - ls * _log_sigmoid(-beta * delta),
        "hinge": np.maximum(0.0, 1 - beta * delta),
        "robust": ((-(1 - ls) * _log_sigmoid(beta * delta) + ls * _log_sigmoid(-beta * delta))
                   / (1 - 2 * ls)),
        "ipo": (((pc / nc - pr / nr) - (rc / nc - rr / nr)) - 1 / (2 * beta)) ** 2,
    }
    for kind, want in expected.items():
        smoothing = ls if kind in ("sigmoid", "robust") else 0.0
        spec = PreferenceLoss(kind, beta=beta, label_smoothing=smoothing)  # type: ignore[arg-type]
        np.testing.assert_allclose(_per_pair(spec), want, rtol=1e-5, atol=1e-6, err_msg=kind)


def test_reference_free_losses_equal_their_formulas() -> None:
    pc, pr, nc, nr, *_ = _numpy_inputs()
    mc, mr = pc / nc, pr / nr
    beta, gamma = 2.0, 0.7
    simpo = -_log_sigmoid(beta * ((mc - mr) - gamma / beta))
    np.testing.assert_allclose(_per_pair(PreferenceLoss("simpo", beta=beta, simpo_gamma=gamma)),
                               simpo, rtol=1e-5)
    log_odds = (mc - mr) - (np.log1p(-np.exp(mc)) - np.log1p(-np.exp(mr)))
    nll = -pc / nc  # one pair: its chosen tokens' mean next-token loss
    np.testing.assert_allclose(_per_pair(PreferenceLoss("orpo", beta=0.1)),
                               nll - 0.1 * _log_sigmoid(log_odds), rtol=1e-5)


def test_metrics_carry_the_names_and_values_trl_reports() -> None:
    loss, metrics = PreferenceLoss("sigmoid", beta=0.1)(POLICY, REFERENCE)
    chosen = 0.1 * (np.asarray(POLICY.chosen) - np.asarray(REFERENCE.chosen))
    rejected = 0.1 * (np.asarray(POLICY.rejected) - np.asarray(REFERENCE.rejected))
    np.testing.assert_allclose(float(loss), np.mean([0.693147, 0.313262, 0.126928]), atol=1e-6)
    np.testing.assert_allclose(float(metrics["rewards/chosen"]), chosen.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rewards/rejected"]), rejected.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rewards/margins"]), (chosen - rejected).mean(),
                               rtol=1e-6)
    assert float(metrics["rewards/accuracies"]) == pytest.approx(np.mean(chosen > rejected))
    assert float(metrics["logps/chosen"]) == pytest.approx(np.mean(POLICY.chosen))
    assert float(metrics["logps/rejected"]) == pytest.approx(np.mean(POLICY.rejected))


def test_policy_equal_to_reference_gives_ln2_and_a_gradient() -> None:
    spec = PreferenceLoss("sigmoid", beta=0.1)

    def loss(chosen: jax.Array) -> jax.Array:
        policy = POLICY._replace(chosen=chosen, rejected=REFERENCE.rejected)
        return spec(policy, REFERENCE)[0]

    value, grad = jax.value_and_grad(loss)(REFERENCE.chosen)
    assert abs(float(value) - math.log(2.0)) < 1e-6
    # d/dc of -log sig(b(c - c_ref) ...) at D = 0 is -b sig(0) / pairs
    np.testing.assert_allclose(np.asarray(grad), np.full(3, -0.1 * 0.5 / 3), rtol=1e-6)


def test_nll_weight_adds_the_chosen_next_token_loss() -> None:
    plain = float(PreferenceLoss("sigmoid")(POLICY, REFERENCE)[0])
    weighted = float(PreferenceLoss("sigmoid", nll_weight=0.5)(POLICY, REFERENCE)[0])
    nll = -float(np.sum(POLICY.chosen)) / float(np.sum(POLICY.chosen_tokens))
    assert weighted == pytest.approx(plain + 0.5 * nll, rel=1e-6)


@pytest.mark.parametrize("kwargs,words", [
    ({"beta": 0.0}, "beta=0.0"),
    ({"label_smoothing": 0.5}, "label_smoothing=0.5"),
    ({"kind": "hinge", "label_smoothing": 0.1}, "not hinge"),
])
def test_bad_settings_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        PreferenceLoss(**kwargs)  # type: ignore[arg-type]


def test_a_reference_loss_without_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="reference"):
        PreferenceLoss("ipo")(POLICY, None)


@pytest.mark.slow  # a transformer compiled twice
@pytest.mark.parametrize("window", [None, 4])  # 4: within a pair, fewer than its tokens
def test_packed_pairs_score_as_each_pair_alone(window: int | None) -> None:
    from trainrun.config import TransformerModel
    from trainrun.data.pair_rows import pack_pairs, pair_length
    from trainrun.data.preference_pairs import Pair
    from trainrun.models import build_model
    from trainrun.models.transformer import SharedPrefixes, bind_transformer

    cfg = TransformerModel(d_model=32, layers=2, heads=2, seq_len=63, vocab=50,
                           sliding_window=window)
    module = bind_transformer(cfg)(build_model(cfg).init(jax.random.key(0)))
    draw = np.random.default_rng(0)

    def ids(n: int) -> np.ndarray:
        return draw.integers(0, 50, n).astype(np.uint32)

    pairs = [Pair(ids(p), ids(c), ids(r)) for p, c, r in ((3, 4, 2), (5, 1, 6), (2, 7, 3),
                                                           (9, 3, 3), (1, 2, 2))]
    rows, slots = pack_pairs(pairs, cfg.seq_len + 1, bins=2)
    assert slots > 1 and len(rows["tokens"]) < len(pairs)  # short pairs share rows

    @jax.jit
    def target_logps(tokens: jax.Array, segments: SharedPrefixes | None,
                     positions: jax.Array | None) -> jax.Array:
        features, _ = module.features(tokens[:, :-1], segments=segments,
                                      segment_positions=positions)
        logits = (features @ module.head_table().T).reshape(*tokens[:, :-1].shape, -1)
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]

    # each pair's prompt once, each answer's branch seeing it (data/pair_rows.py)
    assert all(rows["tokens"].shape[1] >= pair_length(p) for p in pairs)
    target = target_logps(jnp.asarray(rows["tokens"]),
                          SharedPrefixes(*(jnp.asarray(rows[name][:, :-1])
                                           for name in ("pair_slot", "branch", "positions"))),
                          jnp.asarray(rows["positions"][:, :-1]))
    packed, present = PairLogps.of_rows(target, *(jnp.asarray(rows[name]) for name in
                                                   ("segment_ids", "pair_slot", "answer")), slots)
    assert int(present.sum()) == len(pairs)

    def alone(prompt: np.ndarray, answer: np.ndarray) -> float:
        """The sequence alone in a row, no segments: the padding after it is never attended."""
        seq = np.zeros((1, cfg.seq_len + 1), np.int32)
        seq[0, :prompt.size + answer.size] = np.concatenate([prompt, answer])
        picked = target_logps(jnp.asarray(seq), None, None)[0]
        return float(picked[prompt.size - 1:prompt.size + answer.size - 1].sum())

    found = {(float(c), float(r)) for c, r, p in zip(packed.chosen, packed.rejected, present,
                                                     strict=True) if p}
    for pair in pairs:
        want = (alone(pair.prompt, pair.chosen), alone(pair.prompt, pair.rejected))
        assert any(abs(c - want[0]) < 1e-5 and abs(r - want[1]) < 1e-5 for c, r in found), want
    tokens_counted = np.asarray(packed.chosen_tokens)[np.asarray(present)]
    assert sorted(tokens_counted.tolist()) == sorted(float(p.chosen.size) for p in pairs)


def test_absent_pairs_change_neither_the_loss_nor_the_gradient() -> None:
    """Packed rows give every slot a sum; those without a pair (zero sums, zero tokens: ORPO's
    log of 1 - 1) count for nothing, not even a NaN gradient."""
    empty = PairLogps(*(jnp.zeros(2) for _ in range(4)))
    padded_policy = PairLogps(*(jnp.concatenate([x, e])
                                for x, e in zip(POLICY, empty, strict=True)))
    padded_reference = PairLogps(*(jnp.concatenate([x, e])
                                   for x, e in zip(REFERENCE, empty, strict=True)))
    present = jnp.array([True, True, True, False, False])
    for kind in ("sigmoid", "ipo", "orpo", "simpo"):
        spec = PreferenceLoss(kind)  # type: ignore[arg-type]

        def loss(chosen: jax.Array, padded: bool, spec: PreferenceLoss = spec) -> jax.Array:
            policy = (padded_policy if padded else POLICY)._replace(chosen=chosen)
            reference = padded_reference if padded else REFERENCE
            return spec(policy, reference, present if padded else None)[0]

        alone, grad_alone = jax.value_and_grad(loss)(POLICY.chosen, False)
        packed, grad_packed = jax.value_and_grad(loss)(padded_policy.chosen, True)
        np.testing.assert_allclose(float(packed), float(alone), rtol=1e-6, err_msg=kind)
        np.testing.assert_allclose(grad_packed, [*grad_alone, 0.0, 0.0], rtol=1e-6,
                                   err_msg=kind)
