"""A small convolutional classifier, sized for 8x8 digits.

    x [B, H, W, C] ─► per entry of ``channels``: 3x3 conv ─► ReLU ─► 2x2 max-pool
                   ─► flatten ─► dense ``hidden`` (ReLU, dropout) ─► ``classes`` logits
"""

from __future__ import annotations

import itertools

import jax
from flax import nnx

from trainrun.config import CNNModel
from trainrun.models.adapters import Model, from_nnx
from trainrun.models.losses import classification


class CNN(nnx.Module):
    def __init__(self, cfg: CNNModel, rngs: nnx.Rngs):
        widths = [cfg.in_channels, *cfg.channels]
        self.convs = nnx.Dict({
            f"{i}": nnx.Conv(c_in, c_out, kernel_size=(3, 3), rngs=rngs)
            for i, (c_in, c_out) in enumerate(itertools.pairwise(widths))})
        self.count = len(cfg.channels)
        side = cfg.image_size
        for _ in cfg.channels:
            side = _pooled(side)
        self.hidden = nnx.Linear(side * side * widths[-1], cfg.hidden, rngs=rngs)
        self.out = nnx.Linear(cfg.hidden, cfg.classes, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        for i in range(self.count):
            x = jax.nn.relu(self.convs[f"{i}"](x))  # "SAME" padding: size unchanged
            if x.shape[1] >= 2:
                x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        h = jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1)))
        if key is not None:
            h = self.drop(h, deterministic=False, rngs=key)
        return self.out(h)


def _pooled(side: int) -> int:
    """Side length after one 2x2 pool (skipped once the map is a single pixel)."""
    return side // 2 if side >= 2 else side


def make_cnn(cfg: CNNModel) -> Model:
    def loss(module: CNN, batch: dict[str, jax.Array], key: jax.Array | None):
        return classification(module(batch["x"], key), batch["label"])

    return from_nnx(lambda rngs: CNN(cfg, rngs), loss, name="cnn",
                    eval_loss=lambda module, batch: loss(module, batch, None))
