"""The GRPO update's loss: a pure, jittable function of the policy's params, a batch of rollouts
(``rollouts.Rollouts``), their advantages (``policy_gradient.group_advantages``), the old and the
reference log-probabilities of their tokens. The policy's log-probabilities come from one
forward pass of the rollouts' text (``rollouts.token_logps``); ``PolicyGradientLoss`` weighs
them. Its gradient is the update's: what is needed besides the params arrives as arguments, so
a step built on it stays one jitted call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.config import TransformerModel
from trainrun.models.policy_gradient import PolicyGradientLoss
from trainrun.models.transformer import bind_transformer
from trainrun.program.rollouts import Rollouts, token_logps

PyTree = Any
Metrics = dict[str, jax.Array]
GrpoLoss = Callable[..., tuple[jax.Array, Metrics]]


def grpo_loss(cfg: TransformerModel, objective: PolicyGradientLoss) -> GrpoLoss:
    """``(params, rollouts, advantages, old_logps=None, reference_logps=None,
    tokens_in_batch=None) -> (loss, metrics)`` of the policy ``cfg`` describes.

    params: the policy's, in the dtype it computes in; advantages: ``[rows]``, one per
    completion; old_logps: ``[rows, limit]`` of the params that drew the rollouts
    (``rollouts.old_logps``; None: these params, one update per rollout batch, the ratio 1);
    reference_logps: ``[rows, limit]`` (``rollouts.reference_logps``), needed when
    ``objective.beta`` > 0; tokens_in_batch: ``dapo``'s divisor for one microbatch of a batch.

    Metrics: ``PolicyGradientLoss``'s (the clipped fractions ``clip_ratio/...``, ``kl`` when
    ``beta`` > 0), ``entropy`` (the mean over completion tokens of their distribution's
    entropy) and ``completion_length`` (the mean number of completion tokens).
    """
    module_of = bind_transformer(cfg)

    def loss(params: PyTree, rollouts: Rollouts, advantages: jax.Array,
             old_logps: jax.Array | None = None, reference_logps: jax.Array | None = None,
             tokens_in_batch: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
        logps, entropy = token_logps(module_of(params), rollouts.tokens, rollouts.start,
                                     rollouts.limit)
        mask = rollouts.completion_mask
        value, metrics = objective(logps, advantages, mask, old_logps, reference_logps,
                                   tokens_in_batch)
        weight = mask.astype(jnp.float32)
        metrics["entropy"] = jax.lax.stop_gradient(
            (entropy * weight).sum() / jnp.maximum(weight.sum(), 1.0))
        metrics["completion_length"] = rollouts.completion_lengths.astype(jnp.float32).mean()
        return value, metrics

    return loss
