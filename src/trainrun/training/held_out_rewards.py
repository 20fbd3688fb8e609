"""A reinforcement-learning run's answers to prompts scored by its rewards, as ``trainrun eval``
and the run's own evaluations (``eval.every``) report them: each prompt answered as the
rollouts are drawn (at most ``rl.completion_tokens`` tokens unless told, ended by the turn's
end or a stop string; greedy unless a temperature is given), ``reward`` the weighted total's
mean, ``reward_std``, each reward's mean (``rewards/<name>/mean``) and the answers counted; a
reward's None (it does not apply) is left out of the means and shows as null in an answer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from trainrun.config import RLConfig, RunConfig, TransformerModel
from trainrun.data import rewards
from trainrun.data.prompt_records import Prompt, score_completions
from trainrun.models.grpo_transformer import host_metric_names
from trainrun.program.decode import generate_batch
from trainrun.training.completion_text import completion_text
from trainrun.training.model_reward import load_rewards

PyTree = Any


def reward_scores(config: RunConfig, params: PyTree, asked: list[Prompt], *,
                  temperature: float = 0.0, seed: int = 0, batch_size: int = 16,
                  tokens: int | None = None, loaded: Sequence[rewards.Reward] | None = None,
                  step: int = 0) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The scores of ``params``' answers to ``asked`` (module docstring) and each answer's
    record; ``tokens``: the most an answer takes (None: ``rl.completion_tokens``); ``loaded``:
    the run's rewards as loaded before (None: loaded here); ``step``: the step of the params,
    the rewards' ``trainer_state.global_step``."""
    rl, model = config.tuning(RLConfig), config.model
    assert isinstance(model, TransformerModel)
    tokens = rl.completion_tokens if tokens is None else tokens
    text = completion_text(config.data, rl)
    ids = generate_batch(model, params, [p.ids for p in asked], tokens,
                         temperature=temperature, seed=seed, compute=config.precision.compute,
                         stop_ids=text.stop_ids, batch_size=batch_size,
                         top_p=rl.top_p if temperature else 1.0, stop_strings=text.stops)
    texts = text.texts(ids)
    found = list(loaded) if loaded is not None else load_rewards(rl)
    values = score_completions(found, asked, texts, ids,
                               rewards.RunProgress(step, config.steps))
    total = rewards.total(found, values)
    names = host_metric_names(rl)
    # over the answers a reward applies to (it returned no None), as the rollouts' metrics
    scores = {name: rewards.mean_and_std(row)[0] for name, row in
              zip(names[0:2 * len(found):2], values, strict=True)}
    mean, std = rewards.mean_and_std(total)
    scores.update({"reward": mean, "reward_std": std, "answers": float(len(asked))})
    answers = [{"where": p.where, "prompt": p.text, "produced": text, "reward": _number(t),
                "rewards": {spec.name: _number(v) for spec, v in zip(rl.rewards, column,
                                                                    strict=True)}}
               for p, text, t, column in zip(asked, texts, total, values.T, strict=True)]
    return scores, answers


def _number(value: float) -> float | None:
    """A reward as an answer's record holds it: None where none applied (NaN)."""
    return None if math.isnan(value) else float(value)
