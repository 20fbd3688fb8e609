"""The kinds of training run, one module each: ``language.py`` (next-token and supervised
training), ``preference.py`` (DPO and its relatives), ``reinforcement.py`` (GRPO) and
``reward.py`` (Bradley-Terry reward models); ``pairs.py`` what the two kinds on preference pairs
share, ``base.py`` what every kind gives (``RunKind``). ``kind_of`` is the kind of a config;
the config says which it is (``RunConfig.kind``)."""

from __future__ import annotations

from trainrun.config import RunConfig, RunKindName
from trainrun.training.kinds.base import EvalAsked, EvalError, HeldOut, RunData, RunKind, Scores
from trainrun.training.kinds.language import Language
from trainrun.training.kinds.preference import Preference
from trainrun.training.kinds.reinforcement import Reinforcement
from trainrun.training.kinds.reward import Reward

KINDS: dict[RunKindName, RunKind] = {kind.name: kind for kind in (
    Language(), Preference(), Reinforcement(), Reward())}


def kind_of(config: RunConfig) -> RunKind:
    """The kind of run ``config`` describes."""
    return KINDS[config.kind]


__all__ = ["KINDS", "EvalAsked", "EvalError", "HeldOut", "RunData", "RunKind", "Scores",
           "kind_of"]
