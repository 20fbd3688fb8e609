"""A trained reward model used: a reward run's directory (its config and a checkpoint, as a run
writes them) scored through the ``reward_model`` reward of ``rl.rewards``, exported with
``trainrun export`` and scored by transformers, and evaluated on its held-out pairs. Each gives
the rewards the model computed of the same prompts and answers in its training rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import yaml

from trainrun.checkpointing.checkpoints import Checkpoints, checkpoint_dir
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.data import model_tokenizer, rewards
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import PairCounts, encode_pairs
from trainrun.data.tasks import task_records
from trainrun.evaluation.evaluate import evaluate_run
from trainrun.models.kind_models import reward_model
from trainrun.models.reward_transformer import SCORE, body_config, body_params, pair_rewards
from trainrun.models.reward_transformer import read_positions as reads
from trainrun.models.transformer import bind_transformer
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import init_state
from trainrun.training.model_reward import BUILT_IN
from trainrun.training.reward_run import with_pad_id

OVERRIDES = ["model.d_model=32", "model.layers=1", "model.heads=2", "steps=10",
             "data.synthetic_examples=128", "data.eval_fraction=0.125", "data.batch_size=2",
             "eval.batch_size=2", "checkpoint.every=10"]


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    """A reward run's directory at step 10: its config and a checkpoint of params whose score
    head is drawn wide, so the rewards of two answers differ far beyond rounding."""
    run = tmp_path_factory.mktemp("reward") / "runs" / "reward"
    run.mkdir(parents=True)
    config = with_pad_id(load_config("reward", OVERRIDES))
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict()))
    state = init_state(reward_model(config), build_optimizer(config.optimizer, config.steps),
                       config.seed, policy_from_config(config.precision))
    params = {**state.params, SCORE: state.params[SCORE] * 300}
    state = state.replace(params=params)
    with Checkpoints(checkpoint_dir(config, run), config, {}) as checkpoints:
        checkpoints.save(10, state, None, wait=True)
    return run, config, jax.tree.map(np.asarray, params)


def _trained_rewards(config, params, records) -> np.ndarray:
    """``[records, 2]``: each record's chosen and rejected reward as the model computes them
    in its training rows (the run's encoding and packing), one pair a row."""
    tokenizer = model_tokenizer.of_records(config.data)
    pairs = encode_pairs(records, "conversational", tokenizer, 512, 0, PairCounts())
    module = bind_transformer(body_config(config.model))(body_params(params))
    out = []
    for pair in pairs:
        assert not isinstance(pair, str)
        rows, _ = pack_pairs([pair], config.data.seq_len + 1, bins=1)
        read, present = reads(rows, config.model.pad_id)
        out.append(np.asarray(pair_rewards(module, params[SCORE], rows, read))[0])
        assert bool(present[0])
    return np.asarray(out)


def _scored(path_args: dict, records) -> np.ndarray:
    """``[records, 2]``: what the ``reward_model`` reward gives each record's two answers."""
    reward = rewards.load("reward_model", path_args, built_in=BUILT_IN)
    prompts = [r["prompt"] for r in records] * 2
    completions = [r["chosen"] for r in records] + [r["rejected"] for r in records]
    values = rewards.score([reward], prompts, completions, {},
                           [f"record {i}" for i in range(len(completions))])
    return values[0].reshape(2, -1).T


@pytest.mark.slow
def test_the_reward_of_a_reward_run_is_what_it_computed_in_its_rows(reward_run):
    run, config, params = reward_run
    assert config.model.pad_id == 256  # the bytes tokenizer's end of text: TRL's pad
    records = task_records("last", 6)
    want = _trained_rewards(config, params, records)
    assert np.abs(want[:, 0] - want[:, 1]).min() > 1e-3
    np.testing.assert_allclose(_scored({"path": str(run), "batch_size": 4}, records), want,
                               atol=1e-5)


@pytest.mark.slow
def test_an_export_of_a_reward_run_scores_alike_in_transformers_and_as_a_reward(reward_run,
                                                                              tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    run, config, params = reward_run
    out = tmp_path / "exported"
    assert main(["export", str(run), "--to", str(out)]) == 0
    records = task_records("last", 5)
    want = _trained_rewards(config, params, records)
    got = _scored({"path": str(out), "tokenizer": "bytes", "chat_template": "chatml"}, records)
    np.testing.assert_allclose(got, want, atol=1e-5)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, dtype=torch.float32).eval()
    assert model.config.pad_token_id == 256 and model.config.num_labels == 1
    tokenizer = model_tokenizer.of_records(config.data)
    pairs = encode_pairs(records, "conversational", tokenizer, 512, 0, PairCounts())
    sequences = [[*p.prompt.tolist(), *answer.tolist()] for p in pairs
                 if not isinstance(p, str) for answer in (p.chosen, p.rejected)]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [256] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=mask).logits[:, 0].numpy()
    np.testing.assert_allclose(theirs.reshape(-1, 2), want, atol=1e-5)


@pytest.mark.slow
def test_eval_reports_the_accuracy_on_the_held_out_pairs(reward_run):
    run, config, params = reward_run
    result = evaluate_run(run)
    step, scores = result.step, result.scores
    assert step == 10
    held = task_records("last", 128)[7::8]  # eval_fraction 1/8: every 8th record
    rewards_ = _trained_rewards(config, params, held)
    assert scores["accuracy"] == pytest.approx(np.mean(rewards_[:, 0] > rewards_[:, 1]),
                                               abs=1e-6)
    assert 0 < scores["accuracy"] < 1
    assert scores["margin"] == pytest.approx(np.mean(rewards_[:, 0] - rewards_[:, 1]),
                                             rel=1e-4)


@pytest.mark.slow
def test_a_path_that_holds_no_reward_model_is_refused_by_name(tmp_path):
    from conftest import save_tiny_causal_lm

    from trainrun.errors import UserError

    lm = save_tiny_causal_lm(tmp_path / "lm", "llama")
    with pytest.raises(rewards.DataError, match="no score head"):
        rewards.load("reward_model", {"path": str(lm)}, built_in=BUILT_IN)
    with pytest.raises(UserError, match=r"reward_model path .*: no such file"):
        rewards.load("reward_model", {"path": str(tmp_path / "nowhere")}, built_in=BUILT_IN)


def test_a_grpo_run_naming_no_reward_model_is_refused_in_one_line_with_nothing_made(
        tmp_path, capsys):
    other = tmp_path / "not-a-reward-run"
    other.mkdir()
    (other / "config.yaml").write_text("name: mlp\n")  # a run's config: no reward_model
    args = ["train", "--config", "grpo", "--run-dir", str(tmp_path / "grpo"), "steps=2",
            "rl.prompts=2", "rl.group=4", "rl.completion_tokens=8", "model.d_model=32",
            "model.layers=1", "data.synthetic_examples=64", "rl.rewards=[{name: reward_model, "
            f"args: {{path: {other}}}}}]"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a run that trains no reward model" in err, err
    assert not (tmp_path / "grpo").exists()
