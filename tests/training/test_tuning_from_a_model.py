"""The built-in ``dpo`` and ``grpo`` configs start from a Hugging Face model as their headers
say, ``--config dpo init.from=MODEL data.paths=pairs.jsonl``: the model's architecture and
tokenizer take the place of the toy model and the byte tokenizer, whatever its size."""

from __future__ import annotations

import json
import random

import pytest
from conftest import save_tiny_causal_lm, save_tiny_chat_model

from trainrun.cli import main
from trainrun.config import load_config

pytestmark = pytest.mark.slow  # transformers makes the model; each test trains


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("model") / "qwen")


def records(path, kind: str):
    """Pairs (``kind`` dpo) or prompts with answers (grpo) of the "last letter" task, as
    conversations."""
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(512):
            word = "".join(rng.sample("abcdefghijklmnopqrstuvwxyz", 5))
            prompt = [{"role": "user", "content": f"last {word}"}]
            record = ({"prompt": prompt, "chosen": [{"role": "assistant", "content": word[-1]}],
                       "rejected": [{"role": "assistant", "content": word[0]}]}
                      if kind == "dpo" else {"prompt": prompt, "answer": word[-1]})
            out.write(json.dumps(record) + "\n")
    return path


SHORT = {"dpo": ["steps=2", "steps_per_call=1"], "grpo": ["steps=2", "rl.prompts=4"]}


@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_the_builtin_tuning_config_trains_a_model_of_another_size(model_dir, tmp_path, capsys,
                                                                  name):
    """Before: "model.d_model gives d_model=64 in the config, but .../config.json has
    hidden_size 48", and with data.paths, "got data.paths and data.synthetic"."""
    run_dir = tmp_path / "run"
    code = main(["train", "--config", name, "--run-dir", str(run_dir), f"init.from={model_dir}",
                 f"data.paths={records(tmp_path / 'records.jsonl', name)}", *SHORT[name],
                 "eval.every=0", "checkpoint.every=2", "metrics.every=1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"starting from params of {model_dir} (init.from) at step 0" in out
    saved = load_config(str(run_dir / "config.yaml"))
    toy = load_config(name).model
    model = saved.model
    assert (model.d_model, model.vocab, model.kv_heads) == (48, 272, 2)  # type: ignore
    assert (toy.d_model, toy.vocab) != (48, 272)  # type: ignore[union-attr]
    assert saved.data.tokenizer == str(model_dir)  # type: ignore[union-attr]
    assert saved.data.chat_template is None  # type: ignore[union-attr]  # the model's own


def test_a_tokenizer_larger_than_the_models_vocabulary_names_the_fix(tmp_path, capsys):
    """Before, the line ended "(or train from the tokenizer's model with init.from)" though
    init.from was given."""
    small = save_tiny_causal_lm(tmp_path / "small", "qwen2", vocab_size=256, hidden_size=48)
    capsys.readouterr()  # what transformers printed as it saved it
    code = main(["train", "--config", "finetune", "--run-dir", str(tmp_path / "run"),
                 f"init.from={small}", "data.kind=records", "data.tokenizer=bytes",
                 "data.chat_template=chatml", "data.format=preference",
                 f"data.paths={records(tmp_path / 'pairs.jsonl', 'dpo')}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: data.tokenizer 'bytes' has 259 tokens, more than the 256 of the "
                      f"model of init.from {small}; drop data.tokenizer (the records are then "
                      "read with the model's own) or give one of at most 256 tokens")
    assert not (tmp_path / "run").exists()
