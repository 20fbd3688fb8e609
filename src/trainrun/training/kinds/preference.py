"""A preference run (the ``preference`` section): DPO and its relatives (IPO, hinge, robust,
SimPO, ORPO) on pairs of a prompt, a chosen and a rejected answer.

Its modules: the model and its losses (``models/preference_transformer.py``,
``models/preference_losses.py``, the tokens' log-probabilities ``models/token_logps.py``), the
pair rows (``data/preference_rows.py``), the batches and the reference's cached column
(``training/preference_data.py``), and this module: its model, its data (the pair rows and their
held-out rows, ``pairs.py``, which the reward kind shares), its state (the frozen reference's
params, with LoRA none: the adapters turned off), a reference pass before training when the
loss's reference is cached (a point verify-resume kills the run at), and ``trainrun eval``'s
loss and reward metrics against the reference."""

from __future__ import annotations

from typing import Any

import grain

from trainrun.checkpointing import init_from
from trainrun.config import RunConfig
from trainrun.fast.strategies import Strategies
from trainrun.models import Model
from trainrun.models.kind_models import preference_model
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import Policy, policy_from_config
from trainrun.program.state import abstract_state, init_state
from trainrun.reporting.console import Console
from trainrun.storage import location
from trainrun.training.kinds.base import EvalAsked, RunData, RunKind, Scores
from trainrun.training.kinds.pairs import pair_run_data, pair_scores
from trainrun.training.preference_data import cached_reference, preference_data
from trainrun.training.run_parts import Parts

PyTree = Any


class Preference(RunKind):
    """A run with a ``preference`` section (module docstring)."""

    name = "preference"
    state_holds = "the reference's params"

    def model(self, config: RunConfig, chosen: Strategies) -> Model:
        return preference_model(config)

    def data(self, config: RunConfig, parts: Parts, console: Console, given: Any,
             given_eval: grain.MapDataset | None) -> RunData:
        from trainrun.training.restore import fresh_state

        return pair_run_data(config, parts, console, given, given_eval, lambda: preference_data(
            config, parts.policy, lambda: fresh_state(config, parts, self).params,
            parts.placement.rows))

    def reference_pass(self, config: RunConfig) -> bool:
        return config.preference is not None and cached_reference(config.preference)

    def scores(self, config: RunConfig, run: location.Location, asked: EvalAsked) -> Scores:
        model = preference_model(config)
        policy = policy_from_config(config.precision)
        return pair_scores(config, run, asked, model, lambda found: preference_data(
            found, policy, lambda: _start(found, model, policy), (0, 1)))


def _start(config: RunConfig, model: Model, policy: Policy) -> PyTree:
    """The params the run started from: its fresh init, or ``init.from``'s."""
    optimizer = build_optimizer(config.optimizer, config.steps)
    if config.init.from_ is not None:
        abstract = abstract_state(model, optimizer, config.seed, policy)
        return init_from.initial_state(config, model, optimizer, policy, None, abstract).params
    return init_state(model, optimizer, config.seed, policy).params
