"""The low-rank adapter beside a linear layer, or beside each expert's of a mixture of experts:
``y = x W + (alpha / rank) x A B``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainrun.config import LoraConfig


class LoRA(nnx.Module):
    """A low-rank adapter beside a linear layer: adds ``(alpha / rank) x A B``. ``B`` starts at
    zero, so a model with fresh adapters computes what its base computes. ``A`` is drawn by
    ``adapter_draws`` with every other adapter of the model, once the model is built. With
    ``experts``, one adapter per expert: ``a`` ``[experts, d_in, rank]``, ``b`` ``[experts,
    rank, d_out]``, applied by the experts' own blocks (``experts.routed_mlp``)."""

    def __init__(self, d_in: int, d_out: int, cfg: LoraConfig, axes: tuple[str, str],
                 experts: int | None = None):
        lead, lead_axes = ((), ()) if experts is None else ((experts,), ("expert",))
        self.a = nnx.Param(jnp.zeros((*lead, d_in, cfg.rank)), axes=(*lead_axes, axes[0], None))
        self.b = nnx.Param(jnp.zeros((*lead, cfg.rank, d_out)), axes=(*lead_axes, None, axes[1]))
        self.scale = cfg.alpha / cfg.rank

    def __call__(self, x: jax.Array) -> jax.Array:
        # A scaled by alpha / rank: a multiply of the small weights, not of the outputs
        return (x @ self.scaled_a()) @ self.b[...]

    def scaled_a(self) -> jax.Array:
        return self.a[...] * jnp.asarray(self.scale, self.a.dtype)


def adapters_off(params: Any) -> Any:
    """``params`` with every LoRA adapter's ``b`` read as zero: the base model's function (a
    reference model without a second copy of the weights)."""
    def off(path: tuple[Any, ...], leaf: jax.Array) -> jax.Array:
        names = [getattr(part, "key", None) for part in path]
        adapter = len(names) > 1 and str(names[-2]).endswith("_lora") and names[-1] == "b"
        return jnp.zeros_like(leaf) if adapter else leaf

    return jax.tree_util.tree_map_with_path(off, params)
