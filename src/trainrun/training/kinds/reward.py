"""A reward run (the ``reward_model`` section): a transformer's score head trained on preference
pairs with the Bradley-Terry loss, as TRL's ``RewardTrainer`` trains it.

Its modules: the model and its loss (``models/reward_transformer.py``,
``models/reward_losses.py``), its pad token and pair batches (``training/reward_run.py``), the
pair rows and their held-out rows it shares with the preference kind (``pairs.py``), and this
module. ``trainrun eval`` reports the loss and the accuracy on the held-out pairs; a trained
reward model scores a reinforcement-learning run's completions as the built-in reward
``reward_model`` (``training/model_reward.py``)."""

from __future__ import annotations

from typing import Any

import grain

from trainrun.config import RunConfig
from trainrun.fast.strategies import Strategies
from trainrun.models import Model
from trainrun.models.kind_models import reward_model
from trainrun.reporting.console import Console
from trainrun.storage import location
from trainrun.training.kinds.base import EvalAsked, RunData, RunKind, Scores
from trainrun.training.kinds.pairs import pair_run_data, pair_scores
from trainrun.training.reward_run import reward_data, with_pad_id
from trainrun.training.run_parts import Parts


class Reward(RunKind):
    """A run with a ``reward_model`` section (module docstring)."""

    name = "reward"

    def resolved(self, config: RunConfig) -> RunConfig:
        """A reward model reads its score past the tokenizer's pad (``with_pad_id``)."""
        return with_pad_id(config)

    def model(self, config: RunConfig, chosen: Strategies) -> Model:
        return reward_model(config)

    def data(self, config: RunConfig, parts: Parts, console: Console, given: Any,
             given_eval: grain.MapDataset | None) -> RunData:
        return pair_run_data(config, parts, console, given, given_eval,
                             lambda: reward_data(config, parts.placement.rows))

    def scores(self, config: RunConfig, run: location.Location, asked: EvalAsked) -> Scores:
        return pair_scores(config, run, asked, reward_model(config),
                           lambda found: reward_data(found, (0, 1)))
