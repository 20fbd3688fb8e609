"""The default run is the reference chapter's run: bit for bit, not an imitation of it."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainrun.config import load_config
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run


def chapter_losses(steps: int = 200) -> np.ndarray:
    """The chapter's hand-written loop, exactly as written there, recording each step's loss."""

    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (8, 32)) * 0.1, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 1)) * 0.1, "b2": jnp.zeros(1),
        }

    def predict(p, x):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return h @ p["w2"] + p["b2"]

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((predict(p, x) - y) ** 2)

    opt = optax.adam(1e-2)

    @jax.jit
    def train_step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    key = jax.random.key(0)
    params = init(key)
    opt_state = opt.init(params)
    x = jax.random.normal(jax.random.key(1), (256, 8))
    y = jnp.sum(x, axis=1, keepdims=True)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state, (x, y))
        losses.append(loss)
    return np.asarray(jnp.stack(losses))


def trainrun_losses(tmp_path, *overrides: str) -> np.ndarray:
    config = load_config("mlp", list(overrides))
    run(config, tmp_path / "run", out=io.StringIO())
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, config.steps + 1))
    return np.array([r["loss"] for r in records], np.float32)


def test_default_run_is_the_chapter_run_bit_for_bit(tmp_path):
    expected = chapter_losses()
    got = trainrun_losses(tmp_path)
    assert got.tobytes() == expected.tobytes(), (
        f"first differing step {int(np.argmax(got != expected)) + 1}")
    assert got[-1] < got[0] / 100  # and it trains


@pytest.mark.slow
def test_steps_per_call_does_not_change_a_bit(tmp_path):
    one = trainrun_losses(tmp_path / "k1", "steps_per_call=1")
    ten = trainrun_losses(tmp_path / "k10", "steps_per_call=10")
    tail = trainrun_losses(tmp_path / "k7", "steps_per_call=7")  # 200 = 28 * 7 + a tail of 4
    assert one.tobytes() == ten.tobytes()
    assert one.tobytes() == tail.tobytes()
