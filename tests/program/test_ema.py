"""optimizer.ema: the params' moving average lives in the state, follows its formula step by
step (skipped steps leave it), resumes bit for bit, and eval and sampling can use it."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest

from trainrun.config import ConfigError, load_config
from trainrun.data.synthetic import regression_arrays
from trainrun.models import build_model
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import make_train_step
from trainrun.training.loop import run


@pytest.mark.slow
def test_the_average_follows_its_formula_and_skips_a_skipped_step():
    config = load_config("mlp", ["optimizer.ema=0.9", "optimizer.lr=0.05"])
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    state = init_state(model, optimizer, 0)
    batch = regression_arrays(config.data)
    step = jax.jit(make_train_step(model, optimizer))
    expected = jax.tree.map(np.asarray, state.params)
    for _ in range(4):
        state, _ = step(state, batch)
        expected = jax.tree.map(lambda e, p: e + (np.asarray(p) - e) * np.float32(0.1),
                                expected, state.params)
    for got, want in zip(jax.tree.leaves(state.ema), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
    assert not np.allclose(jax.tree.leaves(state.ema)[0], jax.tree.leaves(state.params)[0])
    poisoned = {**batch, "y": batch["y"] * np.float32(np.nan)}  # a non-finite step: skipped
    skipped, _ = step(state, poisoned)
    for got, want in zip(jax.tree.leaves(skipped.ema), jax.tree.leaves(state.ema), strict=True):
        np.testing.assert_array_equal(got, want)
    without = init_state(model, build_optimizer(load_config("mlp").optimizer), 0)
    assert without.ema is None  # no average kept (nor checkpointed) unless asked


@pytest.mark.slow
def test_ema_resumes_bitwise(tmp_path):
    def final_ema(run_dir, *steps: int):
        for n in steps:  # stop at the first, resume to the last
            run(load_config("mlp", [f"steps={n}", "checkpoint.every=5", "optimizer.ema=0.95",
                                    "metrics.tensorboard=false"]), run_dir, out=io.StringIO())
        from trainrun.checkpointing.reader import latest_state

        config = load_config("mlp", [f"steps={steps[-1]}", "optimizer.ema=0.95"])
        return latest_state(run_dir, config)[1].ema

    whole, resumed = final_ema(tmp_path / "whole", 20), final_ema(tmp_path / "resumed", 10, 20)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_eval_can_use_the_average(tmp_path):
    def eval_losses(*extra: str) -> list[float]:
        name = "-".join(extra) or "live"
        run(load_config("digits", ["steps=20", "eval.every=10", "checkpoint.every=0",
                                   "optimizer.schedule.warmup=5", "optimizer.ema=0.9",
                                   "metrics.tensorboard=false", *extra]),
            tmp_path / name, out=io.StringIO())
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        return [r["loss"] for r in rows if r.get("split") == "eval"]

    live, ema = eval_losses(), eval_losses("eval.params=ema")
    assert len(live) == len(ema) == 2 and live != ema
    with pytest.raises(ConfigError, match="needs a moving average"):
        load_config("digits", ["eval.params=ema"])
