"""The reward model's loss: Bradley-Terry on each pair's two scalar rewards (``[pairs]`` each,
float32), as TRL's ``RewardTrainer`` computes it.

- ``-log sig(r_c - r_r - m)``, the mean over the pairs; ``m`` is the pair's margin (the
  records' ``margin`` field where the run reads one, else 0).
- ``center_rewards_coefficient`` ``c`` adds ``c * mean((r_c + r_r)^2)``, which pulls the rewards
  towards mean zero (Eisenstein et al., 2023, eq. 2).

The metrics carry TRL's names: ``accuracy`` (the share of pairs whose chosen answer scores
higher), ``margin`` (the mean of ``r_c - r_r``), ``min_reward``, ``mean_reward`` and
``max_reward`` (over both answers of every pair).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RewardLoss:
    """The Bradley-Terry loss and its setting (TRL's ``RewardConfig`` name).

    center_rewards_coefficient: the weight of the mean squared summed rewards (None: 0).
    """

    center_rewards_coefficient: float | None = None

    def __post_init__(self) -> None:
        coefficient = self.center_rewards_coefficient
        if coefficient is not None and coefficient < 0:
            raise ValueError(f"center_rewards_coefficient={coefficient}: give a number >= 0")

    def __call__(self, chosen: jax.Array, rejected: jax.Array,
                 present: jax.Array | None = None, margin: jax.Array | None = None,
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The mean loss over the pairs and TRL's metrics. present: which pairs count
        (``[pairs]`` booleans); the means are over those, and the others change neither the
        loss nor any gradient. margin: each pair's margin (None: 0)."""
        chosen, rejected = (jnp.asarray(x, jnp.float32) for x in (chosen, rejected))
        held = jnp.ones(chosen.shape, jnp.bool_) if present is None else present
        # an absent pair's values are stand-ins: a NaN there would survive the mask's gradient
        chosen, rejected = jnp.where(held, chosen, 0.0), jnp.where(held, rejected, 0.0)
        count = jnp.maximum(jnp.sum(held, dtype=jnp.float32), 1.0)

        def mean(x: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(held, x, 0.0)) / count

        difference = chosen - rejected
        shifted = difference if margin is None else (
            difference - jnp.where(held, jnp.asarray(margin, jnp.float32), 0.0))
        loss = mean(-jax.nn.log_sigmoid(shifted))
        if self.center_rewards_coefficient is not None:
            loss = loss + self.center_rewards_coefficient * mean((chosen + rejected) ** 2)
        both = jnp.stack([chosen, rejected])
        any_held = jnp.any(held)
        metrics = {
            "accuracy": mean((chosen > rejected).astype(jnp.float32)),
            "margin": mean(difference),
            "min_reward": jnp.where(any_held, jnp.min(jnp.where(held, both, jnp.inf)), 0.0),
            "mean_reward": mean((chosen + rejected) / 2.0),
            "max_reward": jnp.where(any_held, jnp.max(jnp.where(held, both, -jnp.inf)), 0.0),
        }
        return loss, metrics
