"""Preference losses: pure functions of the summed completion log-probabilities of each pair's
chosen and rejected answer (shape ``[pairs]``), in float32. ``sig`` is the logistic function,
``b`` is beta.

``sigmoid`` (DPO), ``ipo``, ``hinge`` and ``robust`` compare the policy with a reference model;
``simpo`` and ``orpo`` need none. The formulas, settings and defaults are those of TRL's
``DPOTrainer``, ``CPOTrainer`` (``loss_type="simpo"``) and ``ORPOTrainer``:

- ``sigmoid``: ``-(1 - ls) log sig(bD) - ls log sig(-bD)`` with ``D = (pc - pr) - (refc - refr)``;
  ``ls`` (label smoothing) 0 is the DPO paper's loss, above 0 the conservative cDPO.
- ``ipo``: ``(D - 1 / 2b)^2`` over log-probabilities averaged per completion token.
- ``hinge``: ``max(0, 1 - bD)``.
- ``robust``: ``((1 - ls)(-log sig(bD)) + ls log sig(-bD)) / (1 - 2 ls)``, unbiased under a
  fraction ``ls`` of flipped labels.
- ``simpo``: ``-(1 - ls) log sig(b(M - g/b)) - ls log sig(-b(M - g/b))`` with ``M`` the
  difference of the per-token mean log-probabilities (length-normalised), ``g`` the margin.
- ``orpo``: the chosen answers' next-token loss minus ``b log sig(log odds(c) - log odds(r))``,
  ``odds(y) = p / (1 - p)`` of the per-token mean probability ``p``.

``nll_weight`` adds ``weight * (mean next-token loss over the chosen completions' tokens)`` to any
loss (TRL's ``cpo_alpha`` and ``rpo_alpha``); ORPO's own term is that with weight 1.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

LossKind = Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"]
REFERENCE_FREE: frozenset[str] = frozenset({"simpo", "orpo"})


class PairLogps(NamedTuple):
    """Each pair's summed completion log-probabilities and completion lengths, ``[pairs]``."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array

    @classmethod
    def of_rows(cls, target_logps: jax.Array, segment_ids: jax.Array, pair_slot: jax.Array,
                answer: jax.Array, slots: int) -> tuple[PairLogps, jax.Array]:
        """Each pair's sums from packed rows (``data/pair_rows.py``): ``target_logps``
        ``[rows, row_len - 1]`` is log p(token t + 1 | tokens up to t); the other three are the
        rows' ``[rows, row_len]`` columns. Returns the ``[rows * slots]`` sums, pair ``r * slots
        + s - 1`` for slot ``s`` of row ``r``, and which of them hold a pair."""
        segments, targets, side = segment_ids[:, :-1], segment_ids[:, 1:], answer[:, 1:]
        counted = (targets == segments) & (segments > 0) & (side > 0)
        rows = jnp.arange(target_logps.shape[0], dtype=jnp.int32)[:, None]
        pair = rows * slots + jnp.maximum(pair_slot[:, 1:], 1) - 1
        index = jnp.where(counted, 2 * pair + side - 1, 2 * slots * target_logps.shape[0])
        count = 2 * slots * target_logps.shape[0]
        sums = jax.ops.segment_sum(jnp.where(counted, target_logps, 0.0).astype(jnp.float32)
                                   .reshape(-1), index.reshape(-1), count + 1)[:count]
        tokens = jax.ops.segment_sum(counted.astype(jnp.float32).reshape(-1),
                                     index.reshape(-1), count + 1)[:count]
        present = (tokens[0::2] > 0) | (tokens[1::2] > 0)
        return cls(sums[0::2], sums[1::2], tokens[0::2], tokens[1::2]), present

    def per_token(self) -> tuple[jax.Array, jax.Array]:
        """The mean log-probability per completion token of the chosen and the rejected."""
        return (self.chosen / jnp.maximum(self.chosen_tokens, 1),
                self.rejected / jnp.maximum(self.rejected_tokens, 1))


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """A preference loss and its settings (TRL's defaults).

    kind: which loss (module docstring).
    beta: the inverse temperature b (DPO's KL weight; IPO's tau; ORPO's lambda).
    label_smoothing: the assumed fraction of flipped labels (``sigmoid``, ``robust``, ``simpo``).
    simpo_gamma: SimPO's target reward margin g.
    nll_weight: weight of the chosen answers' next-token loss added to the loss.
    """

    kind: LossKind = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    nll_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"beta={self.beta}: give a positive number")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing}: give a number in [0, 0.5)")
        if self.label_smoothing and self.kind not in ("sigmoid", "robust", "simpo"):
            raise ValueError(f"label_smoothing applies to sigmoid, robust and simpo, "
                             f"not {self.kind}")

    @property
    def needs_reference(self) -> bool:
        return self.kind not in REFERENCE_FREE

    def __call__(self, policy: PairLogps, reference: PairLogps | None = None,
                 present: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The mean loss over the pairs and the metrics TRL reports under the same names.
        present: which pairs count (``[pairs]`` booleans, ``PairLogps.of_rows``'s); the means
        are over those, and the others change neither the loss nor any gradient."""
        policy = _held(policy, present)
        if self.needs_reference:
            if reference is None:
                raise ValueError(f"the {self.kind} loss compares with a reference model: "
                                 "give its log-probabilities")
            reference = _held(reference, present)
            losses, chosen_reward, rejected_reward = _with_reference(self, policy, reference)
        else:
            losses, chosen_reward, rejected_reward = _reference_free(self, policy)
        weights = (jnp.ones_like(policy.chosen) if present is None else
                   present.astype(jnp.float32))

        def mean(x: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(weights > 0, x, 0.0)) / jnp.maximum(jnp.sum(weights), 1)

        chosen_sum = jnp.sum(jnp.where(weights > 0, policy.chosen, 0.0))
        chosen_tokens = jnp.sum(jnp.where(weights > 0, policy.chosen_tokens, 0.0))
        nll = -chosen_sum / jnp.maximum(chosen_tokens, 1)
        loss = mean(losses)
        if self.kind == "orpo":
            loss = loss + nll
        if self.nll_weight:
            loss = loss + self.nll_weight * nll
        metrics = {
            "rewards/chosen": mean(chosen_reward),
            "rewards/rejected": mean(rejected_reward),
            "rewards/accuracies": mean((chosen_reward > rejected_reward).astype(jnp.float32)),
            "rewards/margins": mean(chosen_reward - rejected_reward),
            "logps/chosen": mean(policy.chosen),
            "logps/rejected": mean(policy.rejected),
            "nll_loss": nll,
        }
        return loss, metrics


def _held(logps: PairLogps, present: jax.Array | None) -> PairLogps:
    """``logps`` in float32, an absent pair's values replaced by a finite stand-in (one token
    of log-probability -1): a loss of its zero sums (ORPO's log of 1 - 1) would be NaN, and a
    NaN's gradient survives the mask."""
    values = PairLogps(*(jnp.asarray(x, jnp.float32) for x in logps))
    if present is None:
        return values
    return PairLogps(*(jnp.where(present, x, stand_in)
                       for x, stand_in in zip(values, (-1.0, -1.0, 1.0, 1.0), strict=True)))


def _with_reference(spec: PreferenceLoss, policy: PairLogps, reference: PairLogps,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    beta, ls = spec.beta, spec.label_smoothing
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    if spec.kind == "ipo":  # IPO compares per-token means (TRL averages its log-probabilities)
        policy_c, policy_r = policy.per_token()
        reference_c, reference_r = reference.per_token()
        delta = (policy_c - policy_r) - (reference_c - reference_r)
        losses = (delta - 1.0 / (2.0 * beta)) ** 2
        chosen_ratio, rejected_ratio = policy_c - reference_c, policy_r - reference_r
    else:
        delta = chosen_ratio - rejected_ratio
        if spec.kind == "sigmoid":
            losses = (-(1.0 - ls) * jax.nn.log_sigmoid(beta * delta)
                      - ls * jax.nn.log_sigmoid(-beta * delta))
        elif spec.kind == "hinge":
            losses = jax.nn.relu(1.0 - beta * delta)
        else:  # robust
            losses = ((-(1.0 - ls) * jax.nn.log_sigmoid(beta * delta)
                       + ls * jax.nn.log_sigmoid(-beta * delta)) / (1.0 - 2.0 * ls))
    return losses, beta * chosen_ratio, beta * rejected_ratio


def _reference_free(spec: PreferenceLoss, policy: PairLogps,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    beta, ls = spec.beta, spec.label_smoothing
    chosen, rejected = policy.per_token()
    if spec.kind == "simpo":
        logits = (chosen - rejected) - spec.simpo_gamma / beta
        losses = (-(1.0 - ls) * jax.nn.log_sigmoid(beta * logits)
                  - ls * jax.nn.log_sigmoid(-beta * logits))
    else:  # orpo: log odds of the per-token mean probability, log(p / (1 - p))
        log_odds = ((chosen - rejected)
                    - (jnp.log1p(-jnp.exp(chosen)) - jnp.log1p(-jnp.exp(rejected))))
        losses = -beta * jax.nn.log_sigmoid(log_odds)
    return losses, beta * chosen, beta * rejected
