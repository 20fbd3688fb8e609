"""The policy-gradient objective of GRPO and its variants: pure functions of per-token
log-probabilities ``[completions, tokens]``, each completion's advantage and the mask of the
tokens it generated, in float32. The formulas and defaults are TRL's ``GRPOTrainer``'s.

- Advantages (``group_advantages``): each prompt's ``G`` rewards less their mean, divided by
  their standard deviation (Bessel-corrected, as ``torch.std``) plus ``eps``. A NaN reward (a
  completion no reward applies to) is left out of its group's mean and deviation and gets
  advantage 0, as TRL's ``nanmean``, ``nanstd`` and ``nan_to_num`` have it. A group whose
  rewards are all equal has none to learn from (``zero_spread_fraction``: TRL's
  ``frac_reward_zero_std``).
- Per token: ``-min(r A, clip(r, 1 - low, 1 + high) A) + beta r k3``, with ``r = exp(logp -
  old logp)`` the ratio to the params that drew the completions and ``k3 = exp(ref - logp) -
  (ref - logp) - 1`` the estimator of the KL divergence to the reference. The KL term is
  weighed by the ratio (TRL's ``use_bias_correction_kl``, on by default): its gradient is the
  reverse KL's, unbiased, and differs from ``k3``'s even where ``r`` is 1.
- Normalisations: ``grpo`` (each completion's mean over its tokens, then the mean over
  completions), ``dapo`` (the sum over every token of the batch divided by their number, which
  may be given for a batch split into microbatches) and ``dr_grpo`` (the sum divided by
  ``completions x max_completion_tokens``, a constant).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Normalisation = Literal["grpo", "dapo", "dr_grpo"]


def group_advantages(rewards: jax.Array, group: int, eps: float = 1e-4,
                     scale: bool = True) -> jax.Array:
    """``[prompts * group]`` rewards (each prompt's ``group`` completions side by side) as
    advantages: less their group's mean and, with ``scale``, divided by its standard deviation
    plus ``eps``; a NaN reward is left out of its group's and its advantage is 0."""
    grouped = jnp.asarray(rewards, jnp.float32).reshape(-1, group)
    centred = grouped - jnp.nanmean(grouped, axis=1, keepdims=True)
    if scale:
        # NaN where fewer than two rewards of a group are numbers, as TRL's nanstd
        spread = jnp.nanstd(grouped, axis=1, ddof=1 if group > 1 else 0, keepdims=True)
        centred = centred / (spread + eps)
    return jnp.nan_to_num(centred.reshape(-1), nan=0.0)


def zero_spread_fraction(rewards: np.ndarray, group: int) -> float:
    """The fraction of ``[prompts * group]`` host rewards' groups whose standard deviation is
    zero (``isclose`` to it, as TRL's ``frac_reward_zero_std``): their advantages are all 0."""
    grouped = np.asarray(rewards, np.float32).reshape(-1, group)
    with warnings.catch_warnings():  # a group with fewer than two numbers: NaN, not zero
        warnings.simplefilter("ignore", RuntimeWarning)
        spread = np.nanstd(grouped, axis=1, ddof=1 if group > 1 else 0)
    return float(np.isclose(spread, 0.0).mean())


@dataclasses.dataclass(frozen=True)
class PolicyGradientLoss:
    """The clipped-ratio objective and its settings (TRL's defaults).

    normalisation: ``grpo``, ``dapo`` or ``dr_grpo`` (module docstring).
    clip_low, clip_high: the ratio's clip range ``[1 - clip_low, 1 + clip_high]``.
    beta: weight of the KL term to the reference (0: no reference needed).
    max_completion_tokens: ``dr_grpo``'s constant (the generation's token limit).
    """

    normalisation: Normalisation = "dapo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    beta: float = 0.0
    max_completion_tokens: int = 0

    def __post_init__(self) -> None:
        if self.normalisation == "dr_grpo" and self.max_completion_tokens < 1:
            raise ValueError("dr_grpo divides by max_completion_tokens: give the token limit")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"clip range [1 - {self.clip_low}, 1 + {self.clip_high}]: give "
                             "clip_low in [0, 1) and clip_high >= 0")

    def __call__(self, logps: jax.Array, advantages: jax.Array, mask: jax.Array,
                 old_logps: jax.Array | None = None, reference_logps: jax.Array | None = None,
                 tokens_in_batch: jax.Array | None = None,
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss and its metrics. ``old_logps`` None: the params that drew the completions
        are these (one update per rollout batch; the ratio is 1, its gradient is not).
        ``tokens_in_batch``: ``dapo``'s divisor when this is one microbatch of a batch."""
        logps = logps.astype(jnp.float32)
        weight = mask.astype(jnp.float32)
        old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
        ratio = jnp.exp(logps - old)
        advantage = advantages.astype(jnp.float32)[:, None]
        clipped = jnp.clip(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        per_token = -jnp.minimum(ratio * advantage, clipped * advantage)
        metrics: dict[str, jax.Array] = {}
        tokens = jnp.maximum(weight.sum(), 1.0)
        if self.beta:
            if reference_logps is None:
                raise ValueError("beta > 0 weighs a KL term to the reference: give its "
                                 "log-probabilities")
            gap = reference_logps.astype(jnp.float32) - logps
            kl = (jnp.exp(gap) - gap - 1.0) * ratio
            per_token = per_token + self.beta * kl
            metrics["kl"] = jax.lax.stop_gradient((kl * weight).sum() / tokens)
        summed = (per_token * weight).sum(axis=-1)
        if self.normalisation == "grpo":
            loss = jnp.mean(summed / jnp.maximum(weight.sum(axis=-1), 1.0))
        elif self.normalisation == "dapo":
            divisor = tokens if tokens_in_batch is None else jnp.maximum(tokens_in_batch, 1.0)
            loss = summed.sum() / divisor
        else:
            loss = summed.sum() / (logps.shape[0] * self.max_completion_tokens)
        low = (ratio < 1.0 - self.clip_low) & (advantage < 0)
        high = (ratio > 1.0 + self.clip_high) & (advantage > 0)
        for name, hit in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                          ("clip_ratio/region_mean", low | high)):
            metrics[name] = jax.lax.stop_gradient((hit * weight).sum() / tokens)
        return loss, metrics
