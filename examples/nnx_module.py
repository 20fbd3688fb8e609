"""Train a Flax NNX module. Copy this file and change the module and its loss.

    python examples/nnx_module.py [RUN_DIR]

trainrun splits the module into its parameters (``nnx.Param``, a plain dict that Optax and Orbax
see) and a static graph, and merges them inside the jitted step. Dropout gets the step's key.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import trainrun


class Classifier(nnx.Module):
    def __init__(self, features: int, hidden: int, classes: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        h = nnx.relu(self.hidden(x))
        h = self.dropout(h, deterministic=rngs is None, rngs=rngs)
        return self.out(h)  # logits: [batch, classes]


def loss(module: Classifier, batch: dict[str, jax.Array], key: jax.Array):
    logits = module(batch["x"], rngs=nnx.Rngs(dropout=key))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return ce, {"accuracy": accuracy}


def blobs(n: int = 2048, classes: int = 4, features: int = 16, seed: int = 0):
    """Gaussian clusters: a small, learnable classification set."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2.0, (classes, features))
    label = rng.integers(0, classes, n)
    x = centers[label] + rng.normal(0, 1.0, (n, features))
    return {"x": x.astype(np.float32), "label": label.astype(np.int32)}


def main(run_dir: str = "runs/nnx_module") -> trainrun.RunSummary:
    config = trainrun.load_config("mlp", [
        "name=nnx_module", "steps=200", "steps_per_call=10", "metrics.every=50",
        "optimizer.lr=0.003", "data.batch_size=128",
    ])
    data = trainrun.ArrayBatches(blobs(), batch_size=128, shuffle=True, seed=config.seed)
    model = trainrun.from_nnx(lambda rngs: Classifier(16, 64, 4, rngs), loss, name="classifier")
    return trainrun.run(config, run_dir, model=model, data=data, fresh=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
