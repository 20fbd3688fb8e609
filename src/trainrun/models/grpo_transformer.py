"""The transformer trained by GRPO: the update's loss, a pure, jittable function of the
policy's params, a batch of rollouts (``Rollouts``, drawn by ``program/rollouts.py``), their
advantages (``policy_gradient.group_advantages``), the old and the reference log-probabilities
of their tokens. The policy's log-probabilities come from one forward pass of the rollouts'
text (``token_logps.rollout_rows``); ``PolicyGradientLoss`` weighs them. Its gradient is the
update's: what is needed besides the params arrives as arguments, so a step built on it stays
one jitted call.

``make_grpo_transformer`` makes that loss a ``Model`` over a rollout batch's columns,
so the one training step (``step.py``) runs it with everything it promises: accumulation
weighted by what the normalisation averages over, precision, sharding, bitwise resume. The
float32 columns (advantages, the old and the reference log-probabilities, the host's reward
statistics) travel as their bits in int32, beyond the compute dtype's cast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import RLConfig, TransformerModel
from trainrun.models.adapters import Model
from trainrun.models.policy_gradient import PolicyGradientLoss
from trainrun.models.token_logps import rollout_rows, token_logps
from trainrun.models.transformer import bind_transformer, make_transformer

PyTree = Any
Metrics = dict[str, jax.Array]
GrpoLoss = Callable[..., tuple[jax.Array, Metrics]]
Batch = dict[str, jax.Array]
# A rollout batch's float32 columns, carried as int32 bits (beside tokens, start,
# completion_mask and completion_lengths).
FLOAT_COLUMNS = ("advantages", "old_logps", "reference_logps", "host_metrics")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollouts:
    """A batch of rollouts: ``rows = prompts x group``, each prompt's ``group`` completions side
    by side (as ``group_advantages`` takes their rewards), ``limit`` the token limit.

    tokens: ``[rows, width + limit]`` int32: the prompt left-padded to ``width``, then the
        completion (0 after its end).
    start: ``[rows]`` int32: each row's first prompt slot (the padding before it).
    completion_mask: ``[rows, limit]`` bool: the completion's tokens (its stop id included).
    completion_lengths: ``[rows]`` int32: their number.
    old_logps: ``[rows, limit]`` float32: each completion token's log-probability under the
        params that drew it (0 outside the mask).
    group: completions per prompt.
    """

    tokens: jax.Array
    start: jax.Array
    completion_mask: jax.Array
    completion_lengths: jax.Array
    old_logps: jax.Array
    group: int = dataclasses.field(metadata={"static": True})

    @property
    def limit(self) -> int:
        return int(self.completion_mask.shape[1])

    @property
    def completions(self) -> jax.Array:
        """``[rows, limit]`` the completions' token ids (0 after each one's end)."""
        return self.tokens[:, -self.limit:]


def grpo_loss(cfg: TransformerModel, objective: PolicyGradientLoss) -> GrpoLoss:
    """``(params, rollouts, advantages, old_logps=None, reference_logps=None,
    tokens_in_batch=None) -> (loss, metrics)`` of the policy ``cfg`` describes.

    params: the policy's, in the dtype it computes in; advantages: ``[rows]``, one per
    completion; old_logps: ``[rows, limit]`` of the params that drew the rollouts
    (``program/rollouts.py``'s ``completion_logps``; None: these params, one update per
    rollout batch, the ratio 1); reference_logps: ``[rows, limit]`` (its ``reference_logps``),
    needed when ``objective.beta`` > 0; tokens_in_batch: ``dapo``'s divisor for one
    microbatch of a batch.

    Metrics: ``PolicyGradientLoss``'s (the clipped fractions ``clip_ratio/...``, ``kl`` when
    ``beta`` > 0), ``entropy`` (the mean over completion tokens of their distribution's
    entropy) and ``completion_length`` (the mean number of completion tokens).
    """
    module_of = bind_transformer(cfg)

    def loss(params: PyTree, rollouts: Rollouts, advantages: jax.Array,
             old_logps: jax.Array | None = None, reference_logps: jax.Array | None = None,
             tokens_in_batch: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
        module = module_of(params)
        logps, entropy = token_logps(module, rollout_rows(module, rollouts.tokens, rollouts.start,
                                                          rollouts.limit, rollouts.group),
                                     chunk=cfg.loss_chunk)
        mask = rollouts.completion_mask
        value, metrics = objective(logps, advantages, mask, old_logps, reference_logps,
                                   tokens_in_batch)
        weight = mask.astype(jnp.float32)
        metrics["entropy"] = jax.lax.stop_gradient(
            (entropy * weight).sum() / jnp.maximum(weight.sum(), 1.0))
        metrics["completion_length"] = rollouts.completion_lengths.astype(jnp.float32).mean()
        return value, metrics

    return loss


def host_metric_names(rl: RLConfig) -> tuple[str, ...]:
    """The metrics the host measures of each rollout batch, in its ``host_metrics`` column's
    order: each reward's mean and standard deviation over the completions
    (``rewards/<name>/mean``, ``.../std``; ``<name>`` the function's), the weighted total's
    (``reward``, ``reward_std``), the fraction of groups whose totals are all equal
    (``frac_reward_zero_std``, TRL's: no advantage to learn from), and the generation's tokens
    per second and the update's (those of the rollout batch before: measured as the next is
    drawn; 0 on the first)."""
    labels: list[str] = []
    for spec in rl.rewards:
        label = spec.name.rpartition(":")[2] or spec.name
        labels.append(label if label not in labels else f"{label}_{len(labels)}")
    per_reward = [f"rewards/{label}/{kind}" for label in labels for kind in ("mean", "std")]
    return (*per_reward, "reward", "reward_std", "frac_reward_zero_std",
            "generation_tokens_per_s", "update_tokens_per_s")


def as_bits(array: np.ndarray) -> np.ndarray:
    """A float32 host column as the int32 bits a rollout batch carries."""
    return np.ascontiguousarray(array, np.float32).view(np.int32)


def make_grpo_transformer(cfg: TransformerModel, rl: RLConfig) -> Model:
    """The transformer ``cfg`` describes with the GRPO loss over rollout batches (module
    docstring). Aux ``weight``: the completion tokens (``dapo``) or the completions (``grpo``,
    ``dr_grpo``), what the loss averages over. With ``rl.beta`` > 0 and no LoRA adapters the
    model state holds the reference (the starting params, kept frozen)."""
    objective = PolicyGradientLoss(rl.normalisation, clip_low=rl.clip_low,
                                   clip_high=rl.clip_high, beta=rl.beta,
                                   max_completion_tokens=rl.completion_tokens)
    policy_loss = grpo_loss(cfg, objective)
    names = host_metric_names(rl)
    base = make_transformer(cfg)

    def loss(params: PyTree, batch: Batch, key: jax.Array,
             model_state: PyTree = None) -> tuple[jax.Array, Metrics, PyTree]:
        floats = {name: jax.lax.bitcast_convert_type(batch[name], jnp.float32)
                  for name in FLOAT_COLUMNS}
        rollouts = Rollouts(batch["tokens"], batch["start"], batch["completion_mask"],
                            batch["completion_lengths"], floats["old_logps"], rl.group)
        # one update per rollout batch: the ratio is 1 exactly, as TRL takes it
        old = floats["old_logps"] if rl.updates > 1 else None
        value, metrics = policy_loss(params, rollouts, floats["advantages"], old,
                                     floats["reference_logps"] if rl.beta else None)
        # every row holds the whole batch's host metrics: their mean is that value
        host = floats["host_metrics"].mean(axis=0)
        metrics.update({name: host[i] for i, name in enumerate(names)})
        mask = batch["completion_mask"]
        weight = (jnp.sum(mask, dtype=jnp.float32) if rl.normalisation == "dapo"
                  else jnp.asarray(mask.shape[0], jnp.float32))
        return value, {**metrics, "weight": weight}, model_state

    keeps_start = rl.beta > 0 and cfg.lora is None
    return dataclasses.replace(
        base, loss=loss, eval_loss=None, name="transformer (grpo)",
        # the starting params, drawn with the same key as the params themselves
        init_model_state=base.init if keeps_start else None)
