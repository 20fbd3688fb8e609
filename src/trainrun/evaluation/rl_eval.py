"""``trainrun eval`` of a reinforcement-learning run: an answer to each of its held-out prompts
(or the prompts of ``--data FILE``; the first ``--limit`` of them when given), generated as its
rollouts are (at most ``rl.completion_tokens`` tokens unless ``--tokens`` says, ended by the
turn's end or a stop string; greedy unless a temperature is given), scored by the run's
rewards: ``reward`` (the weighted total's mean), ``reward_std`` and each reward's mean
(``rewards/<name>/mean``). Each answer, its prompt and its rewards go to ``answers.jsonl``."""

from __future__ import annotations

from typing import Any

from trainrun.config import RecordsData, RunConfig, TransformerModel
from trainrun.data import model_tokenizer, rewards
from trainrun.data.prompt_records import Prompt, completion_texts, prompt_records, score_completions
from trainrun.errors import UserError
from trainrun.program.decode import StopStrings, generate_batch
from trainrun.program.grpo import host_metric_names

PyTree = Any


class PromptsError(UserError):
    """Prompts that cannot be evaluated as asked; one line, exit 2 at the CLI."""


def held_out_prompts(config: RunConfig, data: str | None = None) -> list[Prompt]:
    """The run's held-out prompts, or every prompt of ``data``."""
    assert config.rl is not None and isinstance(config.data, RecordsData)
    section = config.data
    if data is not None:
        section = section.model_copy(update={"eval_paths": (data,), "eval_fraction": 0.0})
    found = prompt_records(section, section.seq_len - config.rl.completion_tokens).eval
    if not found:
        raise PromptsError("the run holds out no prompt (data.eval_fraction is 0 and no "
                           "data.eval_paths); give --data FILE with prompts to score")
    return found


def reward_scores(config: RunConfig, params: PyTree, asked: list[Prompt], *,
                  temperature: float = 0.0, seed: int = 0, batch_size: int = 16,
                  tokens: int | None = None,
                  ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The scores of ``params``' answers to ``asked`` (module docstring) and each answer's
    record; ``tokens``: the most an answer takes (None: ``rl.completion_tokens``)."""
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
    found = [rewards.load(spec.name, spec.args, spec.weight) for spec in rl.rewards]
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


def rl_scores(config: RunConfig, run: Any, data: str | None, ema: bool, *,
              temperature: float, seed: int, batch_size: int, tokens: int | None = None,
              limit: int = 0) -> tuple[int, dict[str, float], list[dict[str, Any]]]:
    """The step of the run's newest checkpoint, its scores and its answers (to the first
    ``limit`` prompts; 0: every one)."""
    from trainrun.checkpointing.reader import latest_state

    asked = held_out_prompts(config, data)
    asked = asked[:limit] if limit else asked
    step, state = latest_state(run, config)
    params = state.ema if ema else state.params
    scores, answers = reward_scores(config, params, asked, temperature=temperature, seed=seed,
                                    batch_size=batch_size, tokens=tokens)
    return step, scores, answers

