"""An MLP as a Flax NNX module: flattened ``x`` -> hidden layers (GELU, dropout) -> outputs.

``task`` picks the loss: mean squared error against ``y`` (regression) or cross-entropy against
``label`` with accuracy (classification); a run's config fills it from the data when not set.
The same data as the plain-function MLP trains it.
"""

from __future__ import annotations

import itertools

import jax
from flax import nnx

from trainrun.config import NNXMLPModel
from trainrun.models.adapters import Model, from_nnx
from trainrun.models.losses import classification, mean_squared_error

# Layers alternate column- and row-split under tensor parallelism (Megatron-style), so the
# hidden activations stay split between a pair of layers.
_AXES = (("embed", "mlp"), ("mlp", "embed"))


class MLP(nnx.Module):
    def __init__(self, cfg: NNXMLPModel, rngs: nnx.Rngs):
        sizes = [cfg.features, *cfg.hidden, cfg.outputs]
        self.layers = nnx.Dict({
            f"{i}": nnx.Linear(d_in, d_out, rngs=rngs,
                               kernel_metadata={"axes": _AXES[i % 2]})
            for i, (d_in, d_out) in enumerate(itertools.pairwise(sizes))})
        self.count = len(sizes) - 1
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        h = x.reshape(x.shape[0], -1)
        for i in range(self.count - 1):
            h = jax.nn.gelu(self.layers[f"{i}"](h))
            if key is not None:
                h = self.drop(h, deterministic=False, rngs=jax.random.fold_in(key, i))
        return self.layers[f"{self.count - 1}"](h)


def make_nnx_mlp(cfg: NNXMLPModel) -> Model:
    def loss(module: MLP, batch: dict[str, jax.Array], key: jax.Array | None):
        out = module(batch["x"], key)
        if cfg.task == "classification":
            return classification(out, batch["label"])
        return mean_squared_error(out, batch["y"]), {}

    return from_nnx(lambda rngs: MLP(cfg, rngs), loss, name="nnx_mlp",
                    eval_loss=lambda module, batch: loss(module, batch, None))
