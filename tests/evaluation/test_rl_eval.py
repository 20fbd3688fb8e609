"""``trainrun eval`` of a reinforcement-learning run: held-out prompts (or a file's) answered as
rollouts are, each answer scored by the run's rewards, the scores their means."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from trainrun.config import load_config
from trainrun.models import build_model
from trainrun.training.held_out_rewards import reward_scores
from trainrun.training.kinds.reinforcement import PromptsError, held_out_prompts

SMALL = ["model.d_model=16", "model.layers=1", "data.synthetic_examples=64",
         "rl.completion_tokens=4",
         'rl.rewards=[{name: format_regex, args: {pattern: "[a-m]"}, weight: 2.0},'
         ' {name: exact_match}]']


def test_each_answer_is_scored_by_the_runs_rewards(tmp_path: Path) -> None:
    config = load_config("grpo", SMALL)
    params = build_model(config.model).init(jax.random.key(0))
    asked = held_out_prompts(config)
    assert len(asked) == 2 and all("answer" in p.fields for p in asked)  # every 32nd of 64
    scores, answers = reward_scores(config, params, asked, temperature=1.0, seed=3)
    for prompt, answer in zip(asked, answers, strict=True):
        regex = float(re.search("[a-m]", answer["produced"]) is not None)
        exact = float(answer["produced"].strip() == prompt.fields["answer"])
        assert answer["rewards"] == {"format_regex": regex, "exact_match": exact}
        assert answer["reward"] == 2.0 * regex + exact and answer["prompt"] == prompt.text
    assert scores["reward"] == pytest.approx(np.mean([a["reward"] for a in answers]))
    assert scores["rewards/format_regex/mean"] == pytest.approx(
        np.mean([a["rewards"]["format_regex"] for a in answers]))
    assert scores["answers"] == 2


def test_a_files_prompts_are_all_asked_and_none_held_out_is_one_line(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n"
                               for i in range(3)))
    config = load_config("grpo", SMALL)
    assert [p.text for p in held_out_prompts(config, str(prompts))] == ["q0", "q1", "q2"]
    with pytest.raises(PromptsError) as err:
        held_out_prompts(load_config("grpo", [*SMALL, "data.eval_fraction=0"]))
    assert "give --data FILE" in str(err.value) and "\n" not in str(err.value)


def test_eval_of_an_rl_run_answers_as_many_prompts_and_tokens_as_asked(tmp_path: Path) -> None:
    import io

    from trainrun.cli import main
    from trainrun.training.loop import run

    config = load_config("grpo", [*SMALL, "steps=1", "rl.prompts=2", "rl.group=2",
                                  "metrics.tensorboard=false"])
    run(config, tmp_path / "run", out=io.StringIO())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "a"}) + "\n"
                               for i in range(3)))

    def answers(*flags: str) -> list[dict]:
        out = tmp_path / f"out{len(flags)}"
        assert main(["eval", str(tmp_path / "run"), "--data", str(prompts), "--out", str(out),
                     "--temperature", "1", *flags]) == 0
        return [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]

    # the run's own limit (rl.completion_tokens, 4 byte tokens: at most a character each)
    # unless --tokens says less
    every = answers()
    assert len(every) == 3 and 2 < max(len(a["produced"]) for a in every) <= 4
    limited = answers("--tokens", "2", "--limit", "1")
    assert len(limited) == 1 and len(limited[0]["produced"]) <= 2
