"""GRPO's advantages and clipped-ratio loss against TRL's formulas, computed in NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.models.policy_gradient import PolicyGradientLoss, group_advantages

DRAW = np.random.default_rng(7)
B, T, G = 6, 5, 3  # completions, tokens, completions per prompt
LOGPS = DRAW.normal(-1.5, 0.5, (B, T)).astype(np.float32)
OLD = (LOGPS + DRAW.normal(0, 0.3, (B, T))).astype(np.float32)
REF = (LOGPS + DRAW.normal(0, 0.2, (B, T))).astype(np.float32)
MASK = np.ones((B, T), bool)
MASK[1, 3:] = MASK[4, 1:] = MASK[5, 4:] = False
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, 2.0, -1.0], np.float32)


def _advantages_numpy(rewards: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    grouped = rewards.astype(np.float64).reshape(-1, G)
    mean, std = grouped.mean(1, keepdims=True), grouped.std(1, ddof=1, keepdims=True)
    return ((grouped - mean) / (std + eps)).reshape(-1)


def test_group_advantages_follow_the_formula() -> None:
    np.testing.assert_allclose(np.asarray(group_advantages(jnp.asarray(REWARDS), G)),
                               _advantages_numpy(REWARDS), atol=1e-6)
    unscaled = np.asarray(group_advantages(jnp.asarray(REWARDS), G, scale=False))
    np.testing.assert_allclose(unscaled, (REWARDS.reshape(-1, G) - REWARDS.reshape(-1, G)
                                          .mean(1, keepdims=True)).reshape(-1), atol=1e-6)


@pytest.mark.parametrize("normalisation", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_equals_trl_formula(normalisation: str, beta: float) -> None:
    spec = PolicyGradientLoss(normalisation, clip_low=0.2, clip_high=0.28, beta=beta,  # type: ignore[arg-type]
                              max_completion_tokens=T)
    adv = _advantages_numpy(REWARDS)
    ratio = np.exp(LOGPS.astype(np.float64) - OLD)
    clipped = np.clip(ratio, 0.8, 1.28)
    per_token = -np.minimum(ratio * adv[:, None], clipped * adv[:, None])
    kl = (np.exp(REF - LOGPS.astype(np.float64)) - (REF - LOGPS) - 1) * ratio
    per_token = per_token + beta * kl
    w = MASK.astype(np.float64)
    want = {"grpo": ((per_token * w).sum(-1) / w.sum(-1)).mean(),
            "dapo": (per_token * w).sum() / w.sum(),
            "dr_grpo": (per_token * w).sum() / (B * T)}[normalisation]
    loss, metrics = spec(jnp.asarray(LOGPS), jnp.asarray(adv, jnp.float32), jnp.asarray(MASK),
                         jnp.asarray(OLD), jnp.asarray(REF))
    assert float(loss) == pytest.approx(want, abs=1e-6)
    low = (ratio < 0.8) & (adv[:, None] < 0)
    high = (ratio > 1.28) & (adv[:, None] > 0)
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx((low * w).sum() / w.sum())
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx((high * w).sum() / w.sum())
    assert ("kl" in metrics) == bool(beta)
    if beta:
        assert float(metrics["kl"]) == pytest.approx((kl * w).sum() / w.sum(), rel=1e-5)


def test_one_update_gives_the_group_baseline_policy_gradient() -> None:
    """A softmax policy over tokens, one logit row per position: with the ratio at 1 and beta
    0 the gradient is -sum A_i (onehot - p) over each completion's tokens, / its length / B."""
    vocab = 4
    theta = jnp.asarray(DRAW.normal(0, 1, (T, vocab)), jnp.float32)
    taken = jnp.asarray(DRAW.integers(0, vocab, (B, T)))
    adv = group_advantages(jnp.asarray(REWARDS), G)

    def loss(theta: jax.Array) -> jax.Array:
        logp = jnp.take_along_axis(jax.nn.log_softmax(theta)[None].repeat(B, 0),
                                   taken[..., None], -1)[..., 0]
        return PolicyGradientLoss("grpo")(logp, adv, jnp.asarray(MASK))[0]

    value, grad = jax.value_and_grad(loss)(theta)
    p = np.asarray(jax.nn.softmax(theta), np.float64)
    a = np.asarray(adv, np.float64)
    hand = np.zeros((T, vocab))
    for i in range(B):
        n = MASK[i].sum()
        for t in range(T):
            if MASK[i, t]:
                hand[t] -= a[i] * (np.eye(vocab)[int(taken[i, t])] - p[t]) / n / B
    np.testing.assert_allclose(np.asarray(grad), hand, atol=1e-6)
    # the ratio is 1: the loss is minus the mean advantage (per completion)
    assert float(value) == pytest.approx(-float(np.mean(a)), abs=1e-6)


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="max_completion_tokens"):
        PolicyGradientLoss("dr_grpo")
    with pytest.raises(ValueError, match="reference"):
        PolicyGradientLoss(beta=0.1)(jnp.asarray(LOGPS), jnp.zeros(B), jnp.asarray(MASK))
