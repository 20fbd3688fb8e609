"""What the two kinds that train on preference pairs share (``preference.py``, ``reward.py``):
the pair rows read once (``training/preference_data.py``), said on the console, their held-out
rows as the run's evaluator reads them (``HeldOutPairs``), and ``trainrun eval``'s scores of
those rows or of the pairs of ``--data FILE`` (``pair_scores``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from trainrun.config import ConfigError, RecordsData, RunConfig
from trainrun.data.pipeline import ArrayBatches
from trainrun.errors import UserError
from trainrun.models import Model
from trainrun.program.decode import HeadLayout
from trainrun.program.precision import policy_from_config
from trainrun.reporting.console import Console
from trainrun.storage import location
from trainrun.training import preflight
from trainrun.training.evaluation import EvalSchedule, Evaluator
from trainrun.training.kinds.base import (
    EvalAsked,
    HeldOut,
    HeldOutBatches,
    RunData,
    Scores,
    batch_evaluator,
    eval_placement,
    given_data,
    host_batches,
)
from trainrun.training.preference_data import PreferenceData, pair_batches
from trainrun.training.run_parts import Parts


class PairsError(UserError):
    """Preference pairs that cannot be evaluated as asked; one line, exit 2 at the CLI."""


@dataclasses.dataclass(frozen=True)
class HeldOutPairs:
    """A pair run's held-out rows (None: the records hold none out)."""

    rows: dict[str, np.ndarray] | None

    def evaluator(self, config: RunConfig, parts: Parts, head: HeadLayout) -> EvalSchedule:
        if self.rows is None:
            raise ConfigError("eval.every is set but the preference records hold no held-out "
                              "pair; give data.eval_paths or a data.eval_fraction that leaves "
                              "one out, or set eval.every=0")
        placement = eval_placement(config, parts)
        dataset = pair_batches(self.rows, placement.global_size, "eval", shuffle=False, seed=0,
                               process_index=placement.rows[0],
                               process_count=placement.rows[1])
        return batch_evaluator(config, parts, dataset, placement, head)


def pair_run_data(config: RunConfig, parts: Parts, console: Console, given: Any,
                  given_eval: grain.MapDataset | None,
                  read: Callable[[], PreferenceData]) -> RunData:
    """A pair run's data: the pairs ``read`` gives, what it says of them on the console, and
    its held-out rows (``given_eval`` in their place where given)."""
    if given is not None:
        held: HeldOut = HeldOutBatches(given_eval) if given_eval is not None else (
            HeldOutPairs(None))
        return given_data(config, given, parts, held)
    pairs = read()
    for notice in [*pairs.notices, pairs.batch_holds]:
        console.message(notice)
    preflight.check_vocab(pairs.counts.vocab, config.model, config.data,
                          config.init.model_source)
    return RunData(dataset=pairs.train, batches=host_batches(config, pairs.train, parts),
                   records=pairs.counts, files=pairs.files,
                   held_out=HeldOutBatches(given_eval) if given_eval is not None
                   else HeldOutPairs(pairs.eval))


def with_eval_file(config: RunConfig, data: str | None) -> RunConfig:
    """``config`` whose held-out records are those of ``data`` alone (None: as it is)."""
    if data is None:
        return config
    assert isinstance(config.data, RecordsData)  # a pair run's
    return config.model_copy(update={"data": config.data.model_copy(
        update={"eval_paths": (data,), "eval_fraction": 0.0})})


def pair_scores(config: RunConfig, run: location.Location, asked: EvalAsked, model: Model,
                read: Callable[[RunConfig], PreferenceData]) -> Scores:
    """The step of the run's newest checkpoint and ``model``'s scores on the held-out pairs
    ``read`` gives, or on the pairs of ``asked.data``, as the run's evaluations computed
    them."""
    from trainrun.checkpointing.reader import latest_state

    step, state = latest_state(run, config, model, optimizer_state=False)
    params = state.ema if asked.ema else state.params
    config = with_eval_file(config, asked.data)
    pairs = read(config)
    if pairs.eval is None:
        raise PairsError(f"run {run} holds out no preference pair (data.eval_fraction is 0 "
                         "and no data.eval_paths); give --data FILE with pairs to score")
    rows = len(next(iter(pairs.eval.values())))
    size = min(config.eval.batch_size or config.data.batch_size, rows)
    dataset = ArrayBatches(pairs.eval, size, shuffle=False, seed=0, split="eval")
    evaluator = Evaluator(model, dataset, every=1, policy=policy_from_config(config.precision))
    return step, evaluator(params, state.model_state), None
