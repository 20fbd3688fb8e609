"""The GRPO update's loss on a transformer's rollouts: with one update per rollout batch its
gradient is the group-baseline policy gradient; its metrics are those of the rollouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import RLConfig, TransformerModel
from trainrun.models import build_model
from trainrun.models.grpo_transformer import (
    Rollouts,
    as_bits,
    grpo_loss,
    host_metric_names,
    make_grpo_transformer,
)
from trainrun.models.policy_gradient import PolicyGradientLoss, group_advantages
from trainrun.models.reference import plain_logits
from trainrun.program.precision import Policy
from trainrun.program.rollouts import RolloutSettings, draw_rollouts
from trainrun.program.step import make_gradient_fn

CFG = TransformerModel(d_model=32, layers=1, heads=4, seq_len=32)
PROMPTS = [np.frombuffer(text, np.uint8) for text in (b"ab", b"import")]
G, LIMIT = 3, 8
REWARDS = np.array([1.0, 0.0, 0.5, 2.0, -1.0, 0.0], np.float32)


@pytest.fixture(scope="module")
def drawn():
    params = build_model(CFG).init(jax.random.key(0))
    # stop ids some completions draw: completions of several lengths
    rollouts = draw_rollouts(CFG, params, PROMPTS, jax.random.key(1), 4,
                             RolloutSettings(G, LIMIT, stop_ids=(10, 32, 101)))
    assert len(set(np.asarray(rollouts.completion_lengths).tolist())) > 1
    return params, rollouts


def next_token_entropy(logits: jax.Array) -> jax.Array:
    """The entropy of each position's next-token distribution, ``logits [..., vocab]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def row_logps(params, text: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The summed log-probability of a row's completion tokens (``mask`` over its last
    ``LIMIT``), and the entropy of each of their distributions, by the plain transformer over
    the row's own text, unpadded."""
    logits = plain_logits(CFG, params, text[None, :-1])[0]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), text[1:, None], axis=-1)
    return (jnp.sum(jnp.where(mask, picked[-LIMIT:, 0], 0.0)),
            next_token_entropy(jax.lax.stop_gradient(logits[-LIMIT:])))


@pytest.fixture(scope="module")
def by_rows(drawn):
    """Each row's gradient of its summed completion log-probability and its tokens'
    entropies, from the row's own text."""
    params, rollouts = drawn
    each = jax.jit(jax.grad(row_logps, has_aux=True))
    return [each(params, rollouts.tokens[row, int(rollouts.start[row]):],
                 rollouts.completion_mask[row]) for row in range(rollouts.tokens.shape[0])]


@pytest.mark.slow
def test_one_update_gives_the_group_baseline_policy_gradient(drawn, by_rows):
    """-sum_i A_i sum_t grad logp_it / the normalisation's divisor, each row's log-probability
    from a forward pass of its own text: the REINFORCE gradient with each group's mean as
    baseline."""
    params, rollouts = drawn
    advantages = group_advantages(jnp.asarray(REWARDS), G)
    mask = np.asarray(rollouts.completion_mask)
    rows = mask.shape[0]
    for normalisation, divisor in (("grpo", mask.sum(axis=1) * rows),
                                   ("dapo", np.full(rows, mask.sum())),
                                   ("dr_grpo", np.full(rows, rows * LIMIT))):
        objective = PolicyGradientLoss(normalisation, max_completion_tokens=LIMIT)  # type: ignore[arg-type]
        loss = grpo_loss(CFG, objective)
        grad = jax.jit(jax.grad(lambda p, loss=loss: loss(p, rollouts, advantages,
                                                          rollouts.old_logps)[0]))(params)
        hand = jax.tree.map(jnp.zeros_like, params)
        for row, (row_grad, _) in enumerate(by_rows):
            weight = -float(advantages[row]) / float(divisor[row])
            hand = jax.tree.map(lambda total, g, w=weight: total + w * g, hand, row_grad)
        for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(hand), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
        assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad)) > 1e-3


@pytest.mark.slow
def test_the_metrics_are_the_rollouts_clip_fraction_kl_entropy_and_length(drawn, by_rows):
    params, rollouts = drawn
    advantages = group_advantages(jnp.asarray(REWARDS), G)
    objective = PolicyGradientLoss("dapo", beta=0.04)
    loss, metrics = jax.jit(grpo_loss(CFG, objective))(
        params, rollouts, advantages, rollouts.old_logps, rollouts.old_logps)
    mask = np.asarray(rollouts.completion_mask)
    # the params that drew them and the reference: ratio 1, nothing clipped, no divergence
    assert float(metrics["clip_ratio/region_mean"]) == 0.0
    assert abs(float(metrics["kl"])) < 1e-6
    # ratio 1: the loss is minus the token-weighted mean advantage
    weighted = (np.asarray(advantages)[:, None] * mask).sum() / mask.sum()
    assert float(loss) == pytest.approx(-weighted, abs=1e-6)
    assert float(metrics["completion_length"]) == pytest.approx(mask.sum(axis=1).mean())
    entropies = np.concatenate([np.asarray(entropy)[mask[row]]
                                for row, (_, entropy) in enumerate(by_rows)])
    assert float(metrics["entropy"]) == pytest.approx(entropies.mean(), abs=1e-5)


def _rollout_batch(rollouts, advantages, old, reference) -> dict[str, np.ndarray]:
    """A rollout batch's columns as the run hands them to the step."""
    metrics = np.zeros((rollouts.tokens.shape[0], len(host_metric_names(RL))), np.float32)
    return {"tokens": np.asarray(rollouts.tokens), "start": np.asarray(rollouts.start),
            "completion_mask": np.asarray(rollouts.completion_mask),
            "completion_lengths": np.asarray(rollouts.completion_lengths),
            "advantages": as_bits(np.asarray(advantages)), "old_logps": as_bits(old),
            "reference_logps": as_bits(reference), "host_metrics": as_bits(metrics)}


RL = RLConfig(group=G, prompts=2, completion_tokens=LIMIT, rewards=({"name": "exact_match"},),
              beta=0.5, updates=2, normalisation="grpo")


@pytest.mark.slow
def test_the_step_reads_old_and_reference_logps_in_float32_under_bfloat16():
    """Under a bfloat16 policy the step's loss is ``grpo_loss`` on the bfloat16 params with
    the float32 old and reference log-probabilities, not their bfloat16 roundings."""
    params = build_model(CFG).init(jax.random.key(0))
    rng = np.random.default_rng(0)
    rows, width = len(REWARDS), 4
    lengths = rng.integers(1, LIMIT + 1, rows).astype(np.int32)
    mask = np.arange(LIMIT)[None] < lengths[:, None]
    tokens = np.where(np.concatenate([np.ones((rows, width), bool), mask], axis=1),
                      rng.integers(1, 200, (rows, width + LIMIT)), 0).astype(np.int32)
    logps = np.where(mask, rng.uniform(-6, -1, (rows, LIMIT)), 0.0).astype(np.float32)
    rollouts = Rollouts(jnp.asarray(tokens), jnp.zeros(rows, jnp.int32), jnp.asarray(mask),
                        jnp.asarray(lengths), jnp.asarray(logps), G)
    advantages = group_advantages(jnp.asarray(REWARDS), G)
    mask = np.asarray(rollouts.completion_mask)
    # off the bfloat16 grid: a cast would move each of them
    old = np.where(mask, np.asarray(rollouts.old_logps) + 1e-3, 0.0).astype(np.float32)
    reference = np.where(mask, old - 0.0123, 0.0).astype(np.float32)
    policy = Policy(compute=jnp.bfloat16)
    gradients = jax.jit(make_gradient_fn(make_grpo_transformer(CFG, RL), policy))
    step_loss = lambda old_, ref_: gradients(
        params, _rollout_batch(rollouts, advantages, old_, ref_), jax.random.key(0),
        policy.initial_loss_scale())[0]
    expected, _ = jax.jit(grpo_loss(CFG, PolicyGradientLoss("grpo", beta=0.5)))(
        policy.cast_to_compute(params), rollouts, advantages, jnp.asarray(old),
        jnp.asarray(reference))
    rounded = lambda x: x.astype(jnp.bfloat16).astype(np.float32)
    assert float(step_loss(old, reference)) == pytest.approx(float(expected), abs=1e-6)
    # the roundings move the loss by far more than the 1e-6 the float32 columns agree within
    assert abs(float(step_loss(rounded(old), rounded(reference))) - float(expected)) > 1e-4


def test_the_update_holds_the_completions_logits_a_chunk_at_a_time(drawn):
    from trainrun.program.precision import equations

    params, rollouts = drawn
    advantages = jnp.asarray(group_advantages(jnp.asarray(REWARDS), G))
    objective = PolicyGradientLoss("dapo")
    tokens = rollouts.tokens.shape[0] * LIMIT  # the completions' positions

    def largest(chunk: int) -> tuple[int, float]:
        loss = grpo_loss(CFG.model_copy(update={"loss_chunk": chunk}), objective)
        grads = jax.grad(lambda p: loss(p, rollouts, advantages)[0])
        big = max(int(np.prod(v.aval.shape)) for e in equations(grads, params)
                  for v in e.outvars if getattr(v.aval, "dtype", None) == jnp.float32)
        return big, float(jax.jit(lambda p: loss(p, rollouts, advantages)[0])(params))

    (whole, value), (chunked, chunked_value) = largest(0), largest(5)
    assert whole >= tokens * CFG.vocab > chunked  # the control holds every completion's logits
    assert abs(value - chunked_value) < 1e-6
