"""A reinforcement-learning run's answers to prompts scored by its rewards, as ``trainrun eval``
and the run's own evaluations (``eval.every``) report them: each prompt answered as the
rollouts are drawn (at most ``rl.completion_tokens`` tokens unless told, ended by the turn's
end or a stop string; greedy unless a temperature is given), ``reward`` the weighted total's
mean, ``reward_std``, each reward's mean (``rewards/<name>/mean``) and the answers counted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainrun.config import RunConfig, TransformerModel
from trainrun.data import model_tokenizer, rewards
from trainrun.data.prompt_records import Prompt, completion_texts, score_completions
from trainrun.program.decode import StopStrings, generate_batch
from trainrun.program.grpo import host_metric_names

PyTree = Any


def reward_scores(config: RunConfig, params: PyTree, asked: list[Prompt], *,
                  temperature: float = 0.0, seed: int = 0, batch_size: int = 16,
                  tokens: int | None = None, loaded: Sequence[rewards.Reward] | None = None,
                  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The scores of ``params``' answers to ``asked`` (module docstring) and each answer's
    record; ``tokens``: the most an answer takes (None: ``rl.completion_tokens``); ``loaded``:
    the run's rewards as loaded before (None: loaded here)."""
    rl, model = config.rl, config.model
    assert rl is not None and isinstance(model, TransformerModel)
    tokens = rl.completion_tokens if tokens is None else tokens
    tokenizer = model_tokenizer.of_records(config.data)
    stops = (StopStrings(rl.stop_strings, tokenizer.tokenizer.decode) if rl.stop_strings
             else None)
    ids = generate_batch(model, params, [p.ids for p in asked], tokens,
                         temperature=temperature, seed=seed, compute=config.precision.compute,
                         stop_ids=tokenizer.stop_ids, batch_size=batch_size,
                         top_p=rl.top_p if temperature else 1.0, stop_strings=stops)
    texts = completion_texts(tokenizer, ids, stops.cut if stops is not None else lambda t: t)
    found = list(loaded) if loaded is not None else rewards.load_each(rl.rewards)
    values = score_completions(found, asked, texts, ids)
    total = rewards.total(found, values)
    names = host_metric_names(rl)
    scores = {name: float(row.mean()) for name, row in
              zip(names[0:2 * len(found):2], values, strict=True)}
    scores.update({"reward": float(total.mean()), "reward_std": float(total.std()),
                   "answers": float(len(asked))})
    answers = [{"where": p.where, "prompt": p.text, "produced": text, "reward": float(t),
                "rewards": {spec.name: float(v) for spec, v in zip(rl.rewards, column,
                                                                   strict=True)}}
               for p, text, t, column in zip(asked, texts, total, values.T, strict=True)]
    return scores, answers
