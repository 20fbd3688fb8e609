"""``trainrun eval`` of a reinforcement-learning run: an answer to each of its held-out prompts
(or the prompts of ``--data FILE``; the first ``--limit`` of them when given), generated as its
rollouts are (at most ``rl.completion_tokens`` tokens unless ``--tokens`` says, ended by the
turn's end or a stop string; greedy unless a temperature is given), scored by the run's
rewards: ``reward`` (the weighted total's mean), ``reward_std`` and each reward's mean
(``rewards/<name>/mean``). Each answer, its prompt and its rewards go to ``answers.jsonl``."""

from __future__ import annotations

from typing import Any

from trainrun.config import RecordsData, RunConfig
from trainrun.data.prompt_records import Prompt, prompt_records
from trainrun.errors import UserError
from trainrun.training.held_out_rewards import reward_scores

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


def rl_scores(config: RunConfig, run: Any, data: str | None, ema: bool, *,
              temperature: float, seed: int, batch_size: int, tokens: int | None = None,
              limit: int = 0) -> tuple[int, dict[str, float], list[dict[str, Any]]]:
    """The step of the run's newest checkpoint, its scores and its answers (to the first
    ``limit`` prompts; 0: every one)."""
    from trainrun.checkpointing.reader import latest_state

    asked = held_out_prompts(config, data)
    asked = asked[:limit] if limit else asked
    step, state = latest_state(run, config, optimizer_state=False)
    params = state.ema if ema else state.params
    scores, answers = reward_scores(config, params, asked, temperature=temperature, seed=seed,
                                    batch_size=batch_size, tokens=tokens, step=step)
    return step, scores, answers

