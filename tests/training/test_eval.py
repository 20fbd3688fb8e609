"""Evaluation on the held-out split: what it reports, where, and that it never changes the
training trajectory."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_env

from trainrun.config import ConfigError, TokenData, load_config
from trainrun.data import ArrayBatches, DataError, build_eval_dataset
from trainrun.models import from_functions
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.evaluation import Evaluator
from trainrun.training.loop import run


def tiny_lm(corpus, *overrides: str):
    return load_config("lm", [
        "steps=9", "steps_per_call=1", "metrics.every=3", "checkpoint.every=0",
        "optimizer.schedule.warmup=2",
        "model.d_model=16", "model.layers=1", "model.heads=2", "model.seq_len=16",
        "model.dropout=0.1",  # the step key is in play: eval must not draw from it
        f"data.paths=[{corpus}]", "data.seq_len=16", "data.batch_size=4",
        "data.eval_fraction=0.25", "data.prefetch_threads=0",
        "eval.batch_size=4", "eval.batches=2", *overrides])


@pytest.mark.slow
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
        build_eval_dataset(TokenData(paths=str(tmp_path / "t.bin"), seq_len=8))


SHARDED_EVAL = textwrap.dedent("""
    import json
    import jax
    from trainrun.program import sharding
    from trainrun.config import load_config
    from trainrun.data import build_eval_dataset
    from trainrun.training.evaluation import Evaluator
    from trainrun.program.state import abstract_state, init_state
    from trainrun.models import build_model
    from trainrun.program.optim import build_optimizer

    config = load_config("digits", ["eval.batches=3"])
    model, opt = build_model(config.model), build_optimizer(config.optimizer, config.steps)
    mesh = sharding.build_mesh(config.mesh)
    shardings = sharding.state_shardings(mesh, abstract_state(model, opt, config.seed),
                                         model.logical_axes, opt.tx, config.mesh)
    params = init_state(model, opt, config.seed, shardings=shardings).params
    placement = sharding.batch_placement(mesh, config.eval.batch_size or config.data.batch_size,
                                         stacked=False)
    data = build_eval_dataset(config.data, placement.global_size)
    sharded = Evaluator(model, data, 1, max_batches=3, put=placement.put,
                        shardings=(shardings.params, placement.sharding))
    whole = Evaluator(model, data, 1, max_batches=3)
    batch = data[0]
    compiled = sharded.fn.lower(params, batch, None).compile()  # no model state
    rows = [list(s.data.shape) for s in jax.device_put(batch["x"], placement.sharding)
            .addressable_shards]
    print(json.dumps({"sharded": sharded(params), "whole": whole(params), "rows": rows,
                      "spec": str(compiled.input_shardings[0][1]["x"].spec)}))
""")


@pytest.mark.slow
def test_eval_batches_are_split_over_the_devices_like_training_batches(tmp_path):
    done = subprocess.run([sys.executable, "-c", SHARDED_EVAL], capture_output=True, text=True,
                          timeout=600, env=cli_env(4))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "data" in out["spec"]  # the compiled eval program takes the batch split by rows
    assert len(out["rows"]) == 4 and len({tuple(r) for r in out["rows"]}) == 1
    assert out["sharded"].keys() == out["whole"].keys() >= {"loss", "accuracy"}
    for name, value in out["whole"].items():
        assert out["sharded"][name] == pytest.approx(value, rel=1e-6)
