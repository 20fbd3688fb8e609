"""Gradient accumulation: M microbatches scanned inside one step give the full-batch gradient."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.cli import main
from trainrun.config import MLPModel, load_config
from trainrun.data.synthetic import regression_arrays
from trainrun.models import from_functions
from trainrun.models.mlp import make_mlp
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import LossScale, Policy
from trainrun.program.state import init_state
from trainrun.program.step import make_gradient_fn, make_multi_step, make_train_step
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run

ONE = LossScale.create()


def relative_error(got, want) -> float:
    """Largest over leaves of ||got - want|| / ||want||."""
    return max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def test_mlp_gradient_of_4_microbatches_equals_the_full_batch():
    model = make_mlp(MLPModel(features=8, hidden=[32], outputs=1))
    params = model.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (64, 8))
    batch = {"x": x, "y": jnp.sum(x, axis=1, keepdims=True)}
    key = jax.random.key(2)
    loss1, _, full, _ = jax.jit(make_gradient_fn(model, Policy(), 1))(params, batch, key, ONE)
    loss4, _, acc, _ = jax.jit(make_gradient_fn(model, Policy(), 4))(params, batch, key, ONE)
    assert relative_error(acc, full) < 1e-6
    assert abs(float(loss4 - loss1)) <= 1e-6 * abs(float(loss1))


def masked_sequence_model():
    """Per-token regression over padded sequences: the loss is the mean over valid tokens and
    the model reports that count as ``weight``, as an LM with padding would."""

    def init(key):
        return {"w": jax.random.normal(key, (4, 1)) * 0.5, "b": jnp.zeros(1)}

    def loss(params, batch, key):
        del key
        pred = (batch["x"] @ params["w"])[..., 0] + params["b"][0]  # [B, T]
        err = (pred - batch["y"]) ** 2 * batch["mask"]
        count = jnp.sum(batch["mask"])
        return jnp.sum(err) / jnp.maximum(count, 1.0), {"weight": count}

    return from_functions(init, loss, name="masked")


@pytest.mark.slow
def test_unequal_valid_tokens_per_microbatch_still_give_the_full_batch_gradient():
    model = masked_sequence_model()
    params = model.init(jax.random.key(0))
    b, t, m = 16, 12, 4
    x = jax.random.normal(jax.random.key(1), (b, t, 4))
    y = jax.random.normal(jax.random.key(2), (b, t))
    # Example j goes to microbatch j % 4; give each microbatch a different number of valid
    # tokens (1, 4, 8, 12 per row), and make microbatch 0 all padding but one row.
    lengths = np.array([[0, 4, 8, 12][j % m] for j in range(b)])
    lengths[0] = 1
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    counts = [mask[i::m].sum() for i in range(m)]
    assert len(set(counts)) == m  # really unequal
    batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
    key = jax.random.key(3)
    _, _, full, _ = jax.jit(make_gradient_fn(model, Policy(), 1))(params, batch, key, ONE)
    _, _, acc, _ = jax.jit(make_gradient_fn(model, Policy(), m))(params, batch, key, ONE)
    assert relative_error(acc, full) < 1e-6

    # The check can fail: the plain mean of the microbatch gradients is not the full gradient.
    @jax.jit
    def plain_mean(params, batch):
        grads = [jax.grad(lambda p, i=i: model.loss(p, jax.tree.map(lambda a: a[i::m], batch),
                                                    key)[0])(params) for i in range(m)]
        return jax.tree.map(lambda *g: sum(g) / m, *grads)

    plain = plain_mean(params, batch)
    assert relative_error(plain, full) > 1e-2


def test_a_microbatch_with_no_valid_tokens_adds_nothing():
    model = masked_sequence_model()
    params = model.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 6, 4))
    y = jax.random.normal(jax.random.key(2), (8, 6))
    mask = np.ones((8, 6), np.float32)
    mask[1::2] = 0.0  # microbatch 1 of 2: all padding (its mean is 0/0 in a careless model)
    batch = {"x": x, "y": y, "mask": jnp.asarray(mask)}
    key = jax.random.key(3)
    _, _, full, _ = jax.jit(make_gradient_fn(model, Policy(), 1))(params, batch, key, ONE)
    loss, _, acc, _ = jax.jit(make_gradient_fn(model, Policy(), 2))(params, batch, key, ONE)
    assert np.isfinite(float(loss))
    assert relative_error(acc, full) < 1e-6


def test_microbatch_i_draws_from_fold_in_of_the_step_key():
    def init(key):
        return {"w": jnp.zeros(3)}

    def loss(params, batch, key):  # d loss / d w = normal(key): the gradient shows the key
        return jnp.sum(params["w"] * jax.random.normal(key, (3,))) + 0.0 * jnp.sum(batch["x"])

    model = from_functions(init, loss)
    params = model.init(jax.random.key(0))
    key = jax.random.key(7)
    grad_fn = jax.jit(make_gradient_fn(model, Policy(), 4))
    _, _, grads, _ = grad_fn(params, {"x": jnp.ones((8, 2))}, key, ONE)
    want = sum(jax.random.normal(jax.random.fold_in(key, i), (3,)) for i in range(4)) / 4
    np.testing.assert_allclose(grads["w"], want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_accumulate_4_trains_like_accumulate_1_over_50_steps(tmp_path):
    config = load_config("mlp", ["steps=50", "accumulate=4"])
    run(config, tmp_path, out=io.StringIO())
    four = np.array([r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")])
    # The same 50 steps on the whole batch (the default run is the chapter's hand loop).
    model, optimizer = make_mlp(config.model), build_optimizer(config.optimizer, 50)
    batches = jax.tree.map(lambda a: np.stack([a] * 50), regression_arrays(config.data))
    steps = jax.jit(make_multi_step(make_train_step(model, optimizer)))
    one = np.asarray(steps(init_state(model, optimizer, config.seed), batches)[1]["loss"])
    assert len(four) == 50
    np.testing.assert_allclose(four, one, rtol=1e-5)
    assert one[-1] < one[0] / 10  # and it trains


@pytest.mark.parametrize("override", ["accumulate=3", "accumulate=0"])
def test_an_accumulate_that_does_not_divide_the_batch_is_a_one_line_error(tmp_path, capsys,
                                                                       override):
    code = main(["train", "--run-dir", str(tmp_path / "run"), override])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "accumulate" in err
    assert not (tmp_path / "run").exists()  # nothing written
