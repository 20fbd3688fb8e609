"""A small residual network with batch normalization, sized for 8x8 digits.

    x [B, H, W, C] ─► 3x3 conv ─► BN ─► ReLU
                  ─► ``blocks`` x [ y = ReLU(BN(conv(ReLU(BN(conv(x)))))) ; x + y ] (ReLU after)
                  ─► global average pool ─► dense ``classes`` logits

Batch normalization keeps running statistics (``nnx.BatchStat``): the model state trainrun
carries beside the params. Training normalizes with the batch's statistics and updates the
running ones; eval normalizes with the running ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trainrun.config import ResNetModel
from trainrun.models.adapters import Model, from_nnx
from trainrun.models.losses import classification


class ConvBN(nnx.Module):
    def __init__(self, c_in: int, c_out: int, momentum: float, rngs: nnx.Rngs):
        self.conv = nnx.Conv(c_in, c_out, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(c_out, momentum=momentum, epsilon=1e-5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Flax normalizes in float32 (the statistics' dtype); back to the compute dtype, so
        # the next convolution runs in it.
        return self.bn(self.conv(x)).astype(x.dtype)


class Residual(nnx.Module):
    def __init__(self, width: int, momentum: float, rngs: nnx.Rngs):
        self.first = ConvBN(width, width, momentum, rngs)
        self.second = ConvBN(width, width, momentum, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x + self.second(jax.nn.relu(self.first(x))))


class ResNet(nnx.Module):
    def __init__(self, cfg: ResNetModel, rngs: nnx.Rngs):
        self.stem = ConvBN(cfg.in_channels, cfg.width, cfg.bn_momentum, rngs)
        self.blocks = nnx.Dict({f"{i}": Residual(cfg.width, cfg.bn_momentum, rngs)
                                for i in range(cfg.blocks)})
        self.count = cfg.blocks
        self.out = nnx.Linear(cfg.width, cfg.classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jax.nn.relu(self.stem(x))
        for i in range(self.count):
            x = self.blocks[f"{i}"](x)
        return self.out(jnp.mean(x, axis=(1, 2)))


def make_resnet(cfg: ResNetModel) -> Model:
    def loss(module: ResNet, batch: dict[str, jax.Array], key: jax.Array | None):
        del key  # no dropout: batch statistics are the regularizer
        return classification(module(batch["x"]), batch["label"])

    return from_nnx(lambda rngs: ResNet(cfg, rngs), loss, name="resnet",
                    eval_loss=lambda module, batch: loss(module, batch, None))
