"""A decoder-only transformer language model, GPT-style, as a Flax NNX module.

    tokens ─► embed (+ learned positions) ─► dropout
           ─► L x [ x + drop(attn(LN(x)))  ;  x + drop(mlp(LN(x))) ]      pre-LayerNorm
           ─► LN ─► logits = x @ embed.T                                   tied embeddings

Attention is causal, through ``jax.nn.dot_product_attention``; positions are rotary (RoPE, on
queries and keys) or a learned table. Dropout draws from the step key. The same blocks run with
a key/value cache for decoding (``prefill`` / ``decode``), so sampling shares the maths of
training.

Every param names its dimensions (``axes`` metadata: "vocab", "embed", "heads", "mlp"); the
sharding rules split "heads" and "mlp" over the tensor axis.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from trainrun.config import TransformerModel
from trainrun.models.adapters import Model, bind_params, from_nnx
from trainrun.models.losses import next_token


class KV(NamedTuple):
    """One layer's key/value cache: ``[batch, max_len, heads, head_dim]`` each."""

    k: jax.Array
    v: jax.Array


class Rope(NamedTuple):
    """Rotary position angles for the positions of a chunk: ``[chunk, head_dim // 2]`` each."""

    sin: jax.Array
    cos: jax.Array

    @classmethod
    def at(cls, positions: jax.Array, head_dim: int, base: float = 10_000.0) -> Rope:
        freqs = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
        angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
        return cls(jnp.sin(angles), jnp.cos(angles))

    def apply(self, x: jax.Array) -> jax.Array:  # x: [batch, chunk, heads, head_dim]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        sin, cos = self.sin[:, None, :], self.cos[:, None, :]
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _linear(d_in: int, d_out: int, axes: tuple[str, str], std: float,
            rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs,
                      kernel_init=nnx.initializers.normal(std), kernel_metadata={"axes": axes})


def _layer_norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs, scale_metadata={"axes": ("embed",)},
                         bias_metadata={"axes": ("embed",)})


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs):
        d, std = cfg.d_model, cfg.init_std
        self.heads = cfg.heads
        self.q = _linear(d, d, ("embed", "heads"), std, rngs)
        self.k = _linear(d, d, ("embed", "heads"), std, rngs)
        self.v = _linear(d, d, ("embed", "heads"), std, rngs)
        # Residual projections start smaller, so the residual stream's variance does not grow
        # with depth (GPT-2).
        self.o = _linear(d, d, ("heads", "embed"), std / math.sqrt(2 * cfg.layers), rngs)

    def __call__(self, x: jax.Array, rope: Rope | None, cache: KV | None = None,
                 pos: jax.Array | int = 0) -> tuple[jax.Array, KV | None]:
        """x: ``[batch, chunk, d_model]`` at positions ``pos ..``. Without a cache the chunk
        attends to itself causally (training); with one, its keys/values are written into the
        cache at ``pos`` and it attends to every cached position up to its own."""
        b, c, d = x.shape
        q, k, v = (proj(x).reshape(b, c, self.heads, d // self.heads)
                   for proj in (self.q, self.k, self.v))
        if rope is not None:
            q, k = rope.apply(q), rope.apply(k)
        if cache is None:
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        else:
            cache = KV(jax.lax.dynamic_update_slice(cache.k, k, (0, pos, 0, 0)),
                       jax.lax.dynamic_update_slice(cache.v, v, (0, pos, 0, 0)))
            visible = jnp.arange(cache.k.shape[1])[None, :] <= pos + jnp.arange(c)[:, None]
            y = jax.nn.dot_product_attention(q, cache.k, cache.v, mask=visible[None, None])
        return self.o(y.reshape(b, c, d)), cache


class MLP(nnx.Module):
    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs):
        d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        self.up = _linear(d, hidden, ("embed", "mlp"), cfg.init_std, rngs)
        self.down = _linear(hidden, d, ("mlp", "embed"),
                            cfg.init_std / math.sqrt(2 * cfg.layers), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


class Block(nnx.Module):
    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = _layer_norm(cfg.d_model, rngs)
        self.mlp = MLP(cfg, rngs)
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, x: jax.Array, rope: Rope | None, key: jax.Array | None,
                 cache: KV | None = None, pos: jax.Array | int = 0) -> tuple[jax.Array, KV | None]:
        y, cache = self.attn(self.ln1(x), rope, cache, pos)
        x = x + _dropout(self.drop, y, key, 0)
        x = x + _dropout(self.drop, self.mlp(self.ln2(x)), key, 1)
        return x, cache


def _dropout(layer: nnx.Dropout, x: jax.Array, key: jax.Array | None, site: int) -> jax.Array:
    """Dropout with its own key per site; off without a key (eval, decoding)."""
    if key is None:
        return x
    return layer(x, deterministic=False, rngs=jax.random.fold_in(key, site))


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs):
        self.layers, self.heads = cfg.layers, cfg.heads
        self.head_dim = cfg.d_model // cfg.heads
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs,
                               embedding_init=nnx.initializers.normal(cfg.init_std),
                               embedding_metadata={"axes": ("vocab", "embed")})
        self.positions = (nnx.Param(nnx.initializers.normal(cfg.init_std)(
            rngs.params(), (cfg.seq_len, cfg.d_model)), axes=(None, "embed"))
            if cfg.positions == "learned" else None)
        self.blocks = nnx.Dict({f"{i}": Block(cfg, rngs) for i in range(cfg.layers)})
        self.ln_f = _layer_norm(cfg.d_model, rngs)
        self.drop = nnx.Dropout(cfg.dropout)

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None,
                 cache: list[KV] | None = None,
                 pos: jax.Array | int = 0) -> tuple[jax.Array, list[KV] | None]:
        """Logits ``[batch, chunk, vocab]`` (float32) for ``tokens`` ``[batch, chunk]`` at
        positions ``pos ..``. ``key``: dropout randomness (None: no dropout). ``cache``: one
        ``KV`` per layer for decoding, returned updated; None for training."""
        chunk = tokens.shape[1]
        positions = pos + jnp.arange(chunk)
        x = self.embed(tokens.astype(jnp.int32))
        rope = None
        if self.positions is None:
            rope = Rope.at(positions, self.head_dim)
        else:
            x = x + jnp.take(self.positions[...], positions, axis=0)[None]
        x = _dropout(self.drop, x, key, 0)
        new_cache = [] if cache is not None else None
        for i in range(self.layers):
            layer_key = None if key is None else jax.random.fold_in(key, i + 1)
            x, kv = self.blocks[f"{i}"](x, rope, layer_key,
                                         None if cache is None else cache[i], pos)
            if new_cache is not None:
                new_cache.append(kv)
        logits = self.embed.attend(self.ln_f(x))
        return logits.astype(jnp.float32), new_cache

    def empty_cache(self, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> list[KV]:
        shape = (batch, max_len, self.heads, self.head_dim)
        return [KV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.layers)]


def _lm_loss(module: Transformer, batch: dict[str, jax.Array], key: jax.Array | None):
    """``batch["tokens"]``: ``[batch, seq_len + 1]``; predict each next token."""
    tokens = batch["tokens"]
    logits, _ = module(tokens[:, :-1], key)
    return next_token(logits, tokens[:, 1:])


def make_transformer(cfg: TransformerModel) -> Model:
    return from_nnx(lambda rngs: Transformer(cfg, rngs), _lm_loss, name="transformer",
                    eval_loss=lambda module, batch: _lm_loss(module, batch, None))


def bind_transformer(cfg: TransformerModel):
    """``params -> Transformer`` holding them (for sampling from trained params)."""
    return bind_params(lambda rngs: Transformer(cfg, rngs), name="transformer")
