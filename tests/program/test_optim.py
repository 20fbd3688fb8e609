"""The optimizer chain and the learning-rate schedules a config builds."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import cli_env

from trainrun.cli import main
from trainrun.config import MLPModel, OptimizerConfig, RegressionData
from trainrun.data.synthetic import regression_arrays
from trainrun.models.mlp import make_mlp
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import make_multi_step, make_train_step
from trainrun.reporting.sinks.jsonl import read_metrics

LR = 0.01
STEPS = 30


def wsd_reference(count: np.ndarray) -> np.ndarray:
    """Warmup 5, hold, linear decay to 0 over the last 40% (12) of 30 steps, by hand."""
    count = count.astype(np.float64)
    decay = np.clip((count - 18) / 12, 0.0, 1.0)
    return np.where(count < 5, LR * count / 5, np.where(count < 18, LR, LR * (1 - decay)))


SCHEDULES = {
    "constant": ([], optax.constant_schedule(LR)),
    "warmup": (["kind=warmup", "warmup=10", "init_lr=0.001"],
               optax.warmup_constant_schedule(0.001, LR, 10)),
    "cosine": (["kind=cosine", "warmup=5", "end_lr=0.0001"],
               optax.warmup_cosine_decay_schedule(0.0, LR, 5, STEPS, end_value=0.0001)),
    # a fraction of the run: 0.2 of 30 steps is 6
    "cosine_fraction": (["kind=cosine", "warmup=0.2", "end_lr=0.0001"],
                        optax.warmup_cosine_decay_schedule(0.0, LR, 6, STEPS, end_value=0.0001)),
    "exponential": (["kind=exponential", "warmup=3", "transition_steps=5",
                     "decay_rate=0.5", "staircase=true", "end_lr=0.001"],
                    optax.warmup_exponential_decay_schedule(0.0, LR, 3, 5, 0.5, staircase=True,
                                                            end_value=0.001)),
    "wsd": (["kind=wsd", "warmup=5", "decay_fraction=0.4"], wsd_reference),
    "piecewise": (["kind=piecewise", "boundaries=[10,20]", "scales=[0.5,0.1]"],
                  optax.piecewise_constant_schedule(LR, {10: 0.5, 20: 0.1})),
}


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory):
    """Every schedule trained through ``trainrun train`` (in parallel processes) with SGD, whose
    update is exactly ``lr * gradient``; the K=7 calls cover the scanned multi-step program."""
    root = tmp_path_factory.mktemp("schedules")
    procs = {}
    for name, (keys, _) in SCHEDULES.items():
        args = [f"--run-dir={root / name}", f"steps={STEPS}", "steps_per_call=7",
                "optimizer.name=sgd", f"optimizer.lr={LR}",
                *[f"optimizer.schedule.{k}" for k in keys]]
        procs[name] = subprocess.Popen([sys.executable, "-m", "trainrun", "train", *args],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=cli_env())
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {err}"
    return {name: read_metrics(root / name / "metrics.jsonl") for name in SCHEDULES}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_logged_lr_is_the_optax_schedule_at_each_step(schedule_runs, name):
    records = schedule_runs[name]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # Metrics of step s describe the update from s - 1 updates done: schedule(s - 1), here
    # compiled as the step compiles it (eager cos rounds differently in the last bits).
    schedule = SCHEDULES[name][1]
    got = np.array([r["lr"] for r in records], np.float32)
    if name == "wsd":  # a float64 reference by hand
        np.testing.assert_allclose(got, schedule(np.arange(STEPS)), rtol=1e-6)
        want = got
    else:
        want = np.array([jax.jit(schedule)(jnp.int32(c)) for c in range(STEPS)], np.float32)
        assert got.tobytes() == want.tobytes(), np.flatnonzero(got != want)
    # And it is the lr SGD applied: its update is lr times the gradient.
    update = np.array([r["update_norm"] for r in records])
    grad = np.array([r["grad_norm"] for r in records])
    np.testing.assert_allclose(update, want * grad, rtol=1e-5)
    if name != "constant":
        assert len(set(got.tolist())) > 2  # the schedule really moves


def test_adamw_decays_weight_matrices_but_not_biases():
    cfg = OptimizerConfig(name="adamw", lr=0.1, weight_decay=0.5)
    opt = build_optimizer(cfg)
    params = {"w": jnp.full((3, 2), 2.0), "b": jnp.full((2,), 2.0), "scale": jnp.full((2,), 2.0)}
    zero = jax.tree.map(jnp.zeros_like, params)  # no gradient: only decay moves a param
    updates, _ = opt.tx.update(zero, opt.tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], 2.0 - 0.1 * 0.5 * 2.0, rtol=1e-6)
    assert jnp.array_equal(new["b"], params["b"])
    assert jnp.array_equal(new["scale"], params["scale"])


def test_clip_norm_bounds_the_update_and_grad_norm_is_logged_before_clipping():
    cfg = OptimizerConfig(name="sgd", lr=1.0, clip_norm=0.001)
    model, optimizer = make_mlp(MLPModel()), build_optimizer(cfg)
    batches = jax.tree.map(lambda a: np.stack([a] * 5), regression_arrays(RegressionData()))
    steps = jax.jit(make_multi_step(make_train_step(model, optimizer)))
    _, metrics = steps(init_state(model, optimizer, seed=0), batches)
    assert np.all(metrics["grad_norm"] > 0.01)
    np.testing.assert_allclose(metrics["update_norm"], 0.001, rtol=1e-5)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "lion"])
def test_each_optimizer_trains_the_mlp(name):
    lr = {"adam": 0.01, "adamw": 0.01, "sgd": 0.05, "lion": 0.003}[name]
    cfg = OptimizerConfig(name=name, lr=lr, momentum=0.9, weight_decay=0.01)
    model, optimizer = make_mlp(MLPModel()), build_optimizer(cfg)
    batch = regression_arrays(RegressionData())
    batches = jax.tree.map(lambda a: np.stack([a] * 60), batch)  # 60 steps in one call
    steps = jax.jit(make_multi_step(make_train_step(model, optimizer)))
    _, metrics = steps(init_state(model, optimizer, seed=0), batches)
    loss = np.asarray(metrics["loss"])
    assert loss[-1] < loss[0] / 5


@pytest.mark.parametrize(("overrides", "words"), [
    (["optimizer.schedule.kind=piecewise", "optimizer.schedule.boundaries=[10]",
      "optimizer.schedule.scales=[0.5,0.1]"], "one scale per boundary"),
    (["optimizer.schedule.kind=cosine", "optimizer.schedule.warmup=500"],
     "optimizer.schedule.warmup=500 leaves no steps to decay in 200 total steps"),
    (["optimizer.schedule.kind=cosine", "optimizer.schedule.warmup=0.999", "steps=2"],
     "optimizer.schedule.warmup=0.999 (2 steps) leaves no steps to decay"),
    (["optimizer.schedule.kind=cosine", "optimizer.schedule.warmup=1.5"],
     "neither a fraction of the run below 1 nor a whole number of steps"),
    (["optimizer.schedule.kind=cosine", "optimizer.schedule.warmups=5"], "'warmup'"),
    (["optimizer.schedule.kind=cosine", "optimizer.schedule.warmup=5",
      "optimizer.schedule.warmup_steps=5"], "keep optimizer.schedule.warmup alone"),
    (["optimizer.clip_norm=-1"], "optimizer.clip_norm"),
])
def test_bad_optimizer_keys_are_one_line_errors(tmp_path, capsys, overrides, words):
    code = main(["train", "--run-dir", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert words in err
    assert not (tmp_path / "run").exists()
