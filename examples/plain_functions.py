"""Train a model written as two plain functions. Copy this file and change the functions.

    python examples/plain_functions.py [RUN_DIR]

A model is ``init(key) -> params`` and ``loss(params, batch, key) -> loss`` (or
``(loss, {"name": metric})``); data is a dict of arrays with examples on axis 0.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import trainrun


def init(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (1, 64)) * 1.0, "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 1)) * 0.1, "b2": jnp.zeros(1),
    }


def loss(params: dict[str, jax.Array], batch: dict[str, jax.Array], key: jax.Array):
    del key  # no randomness in this model
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])  # [batch, 64]
    pred = h @ params["w2"] + params["b2"]  # [batch, 1]
    mse = jnp.mean((pred - batch["y"]) ** 2)
    return mse, {"max_abs_err": jnp.max(jnp.abs(pred - batch["y"]))}


def sine_data(n: int = 1024, seed: int = 0) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).uniform(-3, 3, (n, 1)).astype(np.float32)
    return {"x": x, "y": np.sin(x)}


def main(run_dir: str = "runs/plain_functions") -> trainrun.RunSummary:
    config = trainrun.load_config("mlp", [
        "name=plain_functions", "steps=300", "steps_per_call=10", "metrics.every=100",
        "optimizer.lr=0.01", "data.batch_size=128",
    ])
    data = trainrun.ArrayBatches(sine_data(), batch_size=128, shuffle=True, seed=config.seed)
    model = trainrun.from_functions(init, loss, name="sine_mlp")
    return trainrun.run(config, run_dir, model=model, data=data, fresh=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
