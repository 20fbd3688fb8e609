"""The model each kind of run trains (``RunConfig.kind``; the rest of a kind is its module in
``training/kinds/``), on this floor so that the checkpoint reader, below training, reads a run's
state in its model's shapes without the rest of the kind.

- language: the ``model`` section's model (``build_model``), with the attention and the head's
  loss a fast path chose;
- preference: the transformer trained on pairs with the ``preference`` section's loss
  (``preference_transformer.py``), its model state the frozen reference;
- reinforcement: the GRPO transformer (``grpo_transformer.py``), its model state the params the
  run started from, the reference of its KL term;
- reward: the transformer with a score head and the Bradley-Terry loss
  (``reward_transformer.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainrun.config import RunConfig, RunKindName, TransformerModel
from trainrun.models import build_model
from trainrun.models.adapters import Model

# A kind's model: (config, attention, head's loss) -> Model; None for the plain paths.
ModelOf = Callable[[RunConfig, Any, Any], Model]


def language_model(config: RunConfig, attention: Any = None, head: Any = None) -> Model:
    """The ``model`` section's model."""
    return build_model(config.model, None, attention, head)


def preference_model(config: RunConfig, attention: Any = None, head: Any = None) -> Model:
    """The transformer trained on pairs under the ``preference`` section's loss."""
    return build_model(config.model, config.preference)


def reinforcement_model(config: RunConfig, attention: Any = None, head: Any = None) -> Model:
    """The GRPO transformer of the ``rl`` section."""
    from trainrun.models.grpo_transformer import make_grpo_transformer

    assert config.rl is not None and isinstance(config.model, TransformerModel)
    return make_grpo_transformer(config.model, config.rl)


def reward_model(config: RunConfig, attention: Any = None, head: Any = None) -> Model:
    """The reward model of the ``reward_model`` section: a score head and its loss."""
    from trainrun.models.reward_transformer import make_reward_model

    assert config.reward_model is not None and isinstance(config.model, TransformerModel)
    return make_reward_model(config.model, config.reward_model)


MODELS: dict[RunKindName, ModelOf] = {
    "language": language_model, "preference": preference_model,
    "reinforcement": reinforcement_model, "reward": reward_model}


def kind_model(config: RunConfig, attention: Any = None, head: Any = None) -> Model:
    """The model a run of ``config`` trains."""
    return MODELS[config.kind](config, attention, head)
