"""trainrun's transformer written the plain way, readable in one sitting: the yardstick the fast
one (``transformer.py``) is tested against (same loss and gradients on the same params) and
benchmarked beside (``benchmarks/lm_vs_torch.py --ablation``).

Plain means: whole ``[batch, seq, d]`` activations, two-pass layer norm, rotary angles computed
in the program, ``jax.nn.dot_product_attention``, the whole batch's logits at once. It reads the
fast model's params as they are (``build_model(cfg).init``), biases included where
``model.bias`` gave them; it has no dropout and no LoRA adapters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainrun.config import TransformerModel

Params = Any


def _linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return x @ p["kernel"] + p["bias"] if "bias" in p else x @ p["kernel"]


def _layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def _rotate(x: jax.Array) -> jax.Array:
    """Rotary positions on ``[batch, seq, heads, head_dim]``, halves convention."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 10_000.0 ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def plain_logits(cfg: TransformerModel, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` of ``tokens`` ``[batch, seq]``.

    Raises:
        ValueError: ``cfg`` asks for what this transcription leaves out (dropout, LoRA).
    """
    if cfg.dropout or getattr(cfg, "lora", None) is not None:
        raise ValueError("the plain transformer has no dropout and no LoRA adapters")
    batch, seq = tokens.shape
    d, heads = cfg.d_model, cfg.heads
    head_dim = d // heads
    embedding = params["embed"]["embedding"]
    x = embedding[tokens]
    if cfg.positions == "learned":
        x = x + params["positions"][:seq][None]
    for i in range(cfg.layers):
        block = params["blocks"][str(i)]
        attn, mlp = block["attn"], block["mlp"]
        h = _layer_norm(x, block["ln1"])
        q, k, v = (_linear(h, attn[name]).reshape(batch, seq, heads, head_dim)
                   for name in ("q", "k", "v"))
        if cfg.positions == "rope":
            q, k = _rotate(q), _rotate(k)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + _linear(y.reshape(batch, seq, d), attn["o"])
        h = _layer_norm(x, block["ln2"])
        x = x + _linear(jax.nn.gelu(_linear(h, mlp["up"]), approximate=True), mlp["down"])
    return _layer_norm(x, params["ln_f"]) @ embedding.T


def plain_loss(cfg: TransformerModel, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["tokens"]`` ``[batch, seq + 1]``: the same
    number the fast model's loss gives (float32 params and compute)."""
    tokens = batch["tokens"].astype(jnp.int32)
    logits = plain_logits(cfg, params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
