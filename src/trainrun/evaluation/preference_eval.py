"""``trainrun eval`` of a preference run: the loss over its held-out pairs (or the pairs of
``--data FILE``) and TRL's metrics against the reference (``rewards/accuracies``: the share of
pairs whose chosen answer gains more over the reference than the rejected one;
``rewards/margins``, ``rewards/chosen``, ``rewards/rejected``, ``logps/chosen``,
``logps/rejected``), as evaluation during training computes them. The reference is the run's:
its cached log-probabilities, computed from the starting params where the cache lacks them."""

from __future__ import annotations

from typing import Any

from trainrun.checkpointing import init_from
from trainrun.checkpointing.reader import latest_state
from trainrun.config import RecordsData, RunConfig
from trainrun.data.pipeline import ArrayBatches
from trainrun.errors import UserError
from trainrun.models import Model, build_model
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import Policy, policy_from_config
from trainrun.program.state import abstract_state, init_state
from trainrun.storage import location
from trainrun.training.evaluation import Evaluator
from trainrun.training.preference_data import preference_data

PyTree = Any


class PairsError(UserError):
    """Preference pairs that cannot be evaluated as asked; one line, exit 2 at the CLI."""


def preference_scores(config: RunConfig, run: location.Location, data: str | None,
                      ema: bool) -> tuple[int, dict[str, float]]:
    """The step of the run's newest checkpoint and its scores on the held-out pairs, or on the
    pairs of ``data`` (a JSONL or Parquet file, or a folder or pattern of them)."""
    model = build_model(config.model, config.preference)
    step, state = latest_state(run, config, model, optimizer_state=False)
    params = state.ema if ema else state.params
    assert isinstance(config.data, RecordsData)  # a preference run's
    if data is not None:
        config = config.model_copy(update={"data": config.data.model_copy(
            update={"eval_paths": (data,), "eval_fraction": 0.0})})
    policy = policy_from_config(config.precision)
    pairs = preference_data(config, policy, lambda: _start(config, model, policy), (0, 1))
    if pairs.eval is None:
        raise PairsError(f"run {run} holds out no preference pair (data.eval_fraction is 0 "
                         "and no data.eval_paths); give --data FILE with pairs to score")
    rows = len(next(iter(pairs.eval.values())))
    size = min(config.eval.batch_size or config.data.batch_size, rows)
    dataset = ArrayBatches(pairs.eval, size, shuffle=False, seed=0, split="eval")
    evaluator = Evaluator(model, dataset, every=1, policy=policy)
    return step, evaluator(params, state.model_state)


def _start(config: RunConfig, model: Model, policy: Policy) -> PyTree:
    """The params the run started from: its fresh init, or ``init.from``'s."""
    optimizer = build_optimizer(config.optimizer, config.steps)
    if config.init.from_ is not None:
        abstract = abstract_state(model, optimizer, config.seed, policy)
        return init_from.initial_state(config, model, optimizer, policy, None, abstract).params
    return init_state(model, optimizer, config.seed, policy).params
