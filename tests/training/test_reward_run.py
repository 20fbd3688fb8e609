"""A reward run end to end through ``trainrun train``'s set-up: the ``reward`` config trains a
reward model (its checkpoint holds the score head and no output head, its saved config the pad
token the score is read past), its evaluation during training is what ``trainrun eval`` reports,
and a GRPO run names its directory in ``rl.rewards``: each rollout batch's ``reward_model``
reward is what the trained model scores of the completions the rewards were handed."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from trainrun.checkpointing.reader import latest_params, saved_config
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.models.kind_models import reward_model
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run
from trainrun.training.model_reward import load_reward_model

REWARD = ["model.d_model=32", "model.layers=1", "model.heads=2", "steps=8", "steps_per_call=4",
          "data.synthetic_examples=64", "data.eval_fraction=0.25", "data.batch_size=4",
          "eval.every=8", "eval.batch_size=4", "checkpoint.every=8", "metrics.every=4",
          "metrics.tensorboard=false", "optimizer.lr=0.01"]
GRPO = ["steps=2", "metrics.every=1", "checkpoint.every=2", "rl.prompts=2", "rl.group=4",
        "rl.completion_tokens=8", "model.d_model=32", "model.layers=1",
        "data.synthetic_examples=64", "metrics.tensorboard=false", "eval.every=0"]
# hands back what the rewards were given, to score the same completions outside the run
SEEN = '''
import json


def seen(prompts, completions, log, **fields):
    with open(log, "a") as out:
        out.write(json.dumps({"prompts": prompts, "completions": completions}) + "\\n")
    return [0.0 for _ in completions]
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A trained reward run, and a GRPO run rewarded by it; the log of what its rewards saw."""
    root = tmp_path_factory.mktemp("reward_run")
    reward_dir, grpo_dir = root / "reward", root / "grpo"
    run(load_config("reward", REWARD), reward_dir, out=io.StringIO())
    (root / "seen.py").write_text(SEEN)
    log = root / "seen.jsonl"
    rewards = [{"name": "reward_model", "args": {"path": str(reward_dir)}},
               {"name": f"{root / 'seen.py'}:seen", "args": {"log": str(log)}}]
    run(load_config("grpo", [*GRPO, "rl.rewards=" + json.dumps(rewards)]), grpo_dir,
        out=io.StringIO())
    return reward_dir, grpo_dir, log


@pytest.mark.slow
def test_a_reward_run_trains_a_score_head_read_past_the_tokenizers_pad(runs) -> None:
    reward_dir, _, _ = runs
    config = saved_config(reward_dir)
    assert config.reward_model is not None
    assert config.model.pad_id == 256  # the bytes tokenizer's end of text: TRL's pad
    step, params = latest_params(reward_dir, config)
    assert step == 8 and "head" not in params and params["score"].shape == (1, 32)
    fresh = init_state(reward_model(config), build_optimizer(config.optimizer, config.steps),
                       config.seed).params
    assert not np.allclose(params["score"], fresh["score"])  # the score head trained
    trained = read_metrics(reward_dir / "metrics.jsonl")
    assert trained[-1]["step"] == 8
    assert all(row["pairs"] > 4 for row in trained)  # 4 rows a step, each of several pairs
    assert all(0 <= row["accuracy"] <= 1 for row in trained)


@pytest.mark.slow
def test_eval_reports_the_held_out_accuracy_the_run_measured(runs, tmp_path) -> None:
    reward_dir, _, _ = runs
    held = read_metrics(reward_dir / "metrics.jsonl", "eval")
    assert [row["step"] for row in held] == [8]
    assert main(["eval", str(reward_dir), "--out", str(tmp_path / "eval")]) == 0
    scores = json.loads((tmp_path / "eval" / "scores.json").read_text())
    assert scores["scores"]["accuracy"] == pytest.approx(held[0]["accuracy"], abs=1e-6)
    assert scores["scores"]["loss"] == pytest.approx(held[0]["loss"], rel=1e-5)
    assert not (tmp_path / "eval" / "answers.jsonl").exists()


@pytest.mark.slow
def test_a_grpo_run_is_rewarded_by_the_trained_reward_model(runs) -> None:
    reward_dir, grpo_dir, log = runs
    rows = read_metrics(grpo_dir / "metrics.jsonl")
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    batches = [row for row in rows if "rewards/reward_model/mean" in row]
    assert [row["step"] for row in batches] == [1, 2] and len(seen) >= 2
    model = load_reward_model(str(reward_dir))
    for row, batch in zip(batches, seen, strict=False):
        scores = model.score_texts(batch["prompts"], batch["completions"])
        assert scores.std() > 0  # the completions score differently: the mean is a test
        assert row["rewards/reward_model/mean"] == pytest.approx(scores.mean(), abs=1e-5)
        assert row["rewards/reward_model/std"] == pytest.approx(scores.std(), abs=1e-5)
