"""``trainrun eval`` of a reward run: the loss over its held-out pairs (or the pairs of ``--data
FILE``) and TRL's metrics, as evaluation during training computes them: ``accuracy``, the share
of pairs whose chosen answer the model scores higher; ``margin``, the mean of the chosen answer's
reward less the rejected one's; ``min_reward``, ``mean_reward`` and ``max_reward``."""

from __future__ import annotations

from trainrun.checkpointing.reader import latest_state
from trainrun.config import RecordsData, RunConfig
from trainrun.data.pipeline import ArrayBatches
from trainrun.evaluation.preference_eval import PairsError
from trainrun.program.precision import policy_from_config
from trainrun.storage import location
from trainrun.training.evaluation import Evaluator
from trainrun.training.reward_run import reward_data, reward_model


def reward_scores(config: RunConfig, run: location.Location, data: str | None,
                  ema: bool) -> tuple[int, dict[str, float]]:
    """The step of the run's newest checkpoint and its scores on the held-out pairs, or on the
    pairs of ``data`` (a JSONL or Parquet file, or a folder or pattern of them)."""
    model = reward_model(config)
    step, state = latest_state(run, config, model, optimizer_state=False)
    params = state.ema if ema else state.params
    assert isinstance(config.data, RecordsData)  # a reward run's
    if data is not None:
        config = config.model_copy(update={"data": config.data.model_copy(
            update={"eval_paths": (data,), "eval_fraction": 0.0})})
    pairs = reward_data(config, (0, 1))
    if pairs.eval is None:
        raise PairsError(f"run {run} holds out no preference pair (data.eval_fraction is 0 "
                         "and no data.eval_paths); give --data FILE with pairs to score")
    rows = len(next(iter(pairs.eval.values())))
    size = min(config.eval.batch_size or config.data.batch_size, rows)
    dataset = ArrayBatches(pairs.eval, size, shuffle=False, seed=0, split="eval")
    evaluator = Evaluator(model, dataset, every=1, policy=policy_from_config(config.precision))
    return step, evaluator(params, state.model_state)
