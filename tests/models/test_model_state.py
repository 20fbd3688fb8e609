"""Model state beside the params: BatchNorm's running statistics ride in TrainState, are
updated by the step (never by the optimizer), kept by a skipped step, checkpointed and resumed
bit for bit, and used (not updated) by eval."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest

from trainrun.config import load_config
from trainrun.models import build_model
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import make_eval_step, make_train_step
from trainrun.training.loop import run

SMALL = ["model.width=16", "optimizer.schedule.warmup=20", "metrics.tensorboard=false"]


@pytest.mark.slow
def test_the_step_updates_running_statistics_and_eval_only_reads_them():
    config = load_config("digits_resnet", SMALL)
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 400)
    state = init_state(model, optimizer, 0)
    names = {".".join(str(k.key) for k in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(state.model_state)}
    assert names and all(n.endswith(("mean", "var")) for n in names)
    assert not any("mean" in ".".join(str(k.key) for k in path)
                   for path, _ in jax.tree_util.tree_leaves_with_path(state.params))
    rng = np.random.default_rng(0)
    batch = {"x": rng.random((32, 8, 8, 1), np.float32), "label": rng.integers(0, 10, 32)}
    new, _ = jax.jit(make_train_step(model, optimizer))(state, batch)
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(new.model_state),
                                                   jax.tree.leaves(state.model_state),
                                                   strict=True)]
    assert all(moved)  # every running mean and variance moved toward the batch's
    evaluate = jax.jit(make_eval_step(model))
    fresh_stats = evaluate(new.params, batch, state.model_state)["loss"]
    trained_stats = evaluate(new.params, batch, new.model_state)["loss"]
    assert float(fresh_stats) != float(trained_stats)  # eval normalizes with the running ones
    poisoned = {**batch, "x": batch["x"] * np.float32(np.nan)}
    skipped, _ = jax.jit(make_train_step(model, optimizer))(new, poisoned)
    for a, b in zip(jax.tree.leaves(skipped.model_state), jax.tree.leaves(new.model_state),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # a skipped step leaves the statistics too


@pytest.mark.slow
def test_the_resnet_learns_digits_through_its_running_statistics(tmp_path):
    config = load_config("digits_resnet", [*SMALL, "steps=250", "eval.every=250",
                                           "checkpoint.every=0"])
    run(config, tmp_path, out=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    final_eval = [r for r in rows if r.get("split") == "eval"][-1]
    assert final_eval["accuracy"] >= 0.97, final_eval


@pytest.mark.slow
def test_the_resnet_resumes_bitwise(cli, tmp_path):
    result = cli("verify-resume", "--config", "digits_resnet", "--work-dir",
                 str(tmp_path / "verify"), *SMALL, "model.blocks=1", "steps=40",
                 "checkpoint.every=10", "eval.every=20")
    assert result.returncode == 0 and "PASS" in result.stdout, (result.stdout
                                                                + result.stderr[-2000:])
