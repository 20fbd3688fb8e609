"""The reference chapter's MLP as plain functions: ``features -> hidden... (ReLU) -> outputs``.

With the default sizes (8 -> 32 -> 1, init scale 0.1) ``init`` and ``predict`` are the chapter's
own, op for op, so a run of ``configs/mlp.yaml`` reproduces its hand-written loop bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trainrun.config import MLPModel
from trainrun.models.adapters import Model, from_functions

Params = dict[str, jax.Array]


def make_mlp(cfg: MLPModel) -> Model:
    sizes = [cfg.features, *cfg.hidden, cfg.outputs]
    n_layers = len(sizes) - 1

    def init(key: jax.Array) -> Params:
        keys = jax.random.split(key, n_layers)
        params: Params = {}
        for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
            params[f"w{i + 1}"] = jax.random.normal(k, (fan_in, fan_out)) * cfg.init_scale
            params[f"b{i + 1}"] = jnp.zeros(fan_out)
        return params

    def predict(params: Params, x: jax.Array) -> jax.Array:  # x: [batch, features]
        h = x
        for i in range(1, n_layers):
            h = jax.nn.relu(h @ params[f"w{i}"] + params[f"b{i}"])
        return h @ params[f"w{n_layers}"] + params[f"b{n_layers}"]

    def loss(params: Params, batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
        del key  # deterministic model
        return jnp.mean((predict(params, batch["x"]) - batch["y"]) ** 2)

    # Tensor parallelism, Megatron style: odd layers split their output dim ("mlp": column
    # parallel), even layers their input dim (row parallel), so a pair needs one all-reduce.
    axes: dict[str, tuple[str, ...]] = {}
    for i in range(1, n_layers + 1):
        names = ("embed", "mlp") if i % 2 else ("mlp", "embed")
        axes[f"w{i}"], axes[f"b{i}"] = names, names[1:]
    return dataclasses.replace(from_functions(init, loss, name="mlp"), logical_axes=axes)
