"""Evaluation on the held-out split: what it reports, where, and that it never changes the
training trajectory."""

from __future__ import annotations

import io
import json

import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import ConfigError, TokenData, load_config
from trainrun.data import ArrayBatches, DataError, build_eval_dataset
from trainrun.evaluation import Evaluator
from trainrun.loop import run
from trainrun.models import from_functions
from trainrun.writers import read_metrics


def tiny_lm(corpus, *overrides: str):
    return load_config("lm", [
        "steps=9", "steps_per_call=1", "log_every=3", "checkpoint.every=0",
        "optimizer.schedule.warmup_steps=2",
        "model.d_model=16", "model.layers=1", "model.heads=2", "model.seq_len=16",
        "model.dropout=0.1",  # the step key is in play: eval must not draw from it
        f"data.paths=[{corpus}]", "data.seq_len=16", "data.batch_size=4",
        "data.eval_fraction=0.25", "data.prefetch_threads=0",
        "eval.batch_size=4", "eval.batches=2", *overrides])


def test_eval_lines_leave_train_losses_bitwise_equal(tmp_path):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"".join(f"def f{i}(x):\n    return x * {i}\n\n".encode()
                                for i in range(60)))
    with_eval = tmp_path / "with"
    # K=2 with eval every 3: eval steps cut the calls (2, 1, 2, 1, ...); K never changes a bit
    run(tiny_lm(corpus, "eval.every=3", "steps_per_call=2"), with_eval,
        out=(console := io.StringIO()))
    run(tiny_lm(corpus, "eval.every=0"), tmp_path / "without", out=io.StringIO())

    train = [r["loss"] for r in read_metrics(with_eval / "metrics.jsonl")]
    plain = [r["loss"] for r in read_metrics(tmp_path / "without" / "metrics.jsonl")]
    assert len(train) == 9
    assert np.array(train, np.float32).tobytes() == np.array(plain, np.float32).tobytes()

    evals = read_metrics(with_eval / "metrics.jsonl", split="eval")
    assert [r["step"] for r in evals] == [3, 6, 9]  # every 3 steps
    for record in evals:
        assert {"loss", "accuracy", "bits_per_byte"} <= record.keys()
        assert record["bits_per_byte"] == pytest.approx(record["loss"] / np.log(2), rel=1e-6)
    assert evals[-1]["loss"] < evals[0]["loss"] < np.log(256)
    assert "eval step 9/9  loss" in console.getvalue()

    lines = (with_eval / "metrics.jsonl").read_text().splitlines()
    steps = [(r["step"], r.get("split", "train")) for r in map(json.loads, lines)]
    assert steps.index((3, "eval")) == steps.index((3, "train")) + 1  # in step order


def test_eval_is_the_mean_over_every_held_out_example():
    """Three batches of 4 examples: the reported means are over all 12."""
    values = np.arange(12, dtype=np.float32)
    data = ArrayBatches({"v": values}, 4, shuffle=False, seed=0, split="eval")

    def loss(params, batch, key):
        del params, key
        return jnp.mean(batch["v"]), {"accuracy": jnp.mean(batch["v"] > 5)}

    model = from_functions(lambda key: {}, loss)
    assert Evaluator(model, data, every=1)({}) == {"loss": 5.5, "accuracy": 0.5}
    first_two = Evaluator(model, data, every=1, max_batches=2)({})
    assert first_two == {"loss": 3.5, "accuracy": pytest.approx(2 / 8)}


def test_eval_without_a_held_out_split_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no held-out split"):
        load_config("mlp", ["eval.every=10"])
    (tmp_path / "t.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match=r"give data\.eval"):
        build_eval_dataset(TokenData(train=str(tmp_path / "t.bin"), seq_len=8))
