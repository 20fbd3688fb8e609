"""trainrun's transformer written the plain way, readable in one sitting: the yardstick the fast
one (``transformer.py``) is tested against (same loss and gradients on the same params) and
benchmarked beside (``benchmarks/lm_vs_torch.py --ablation``).

Plain means: whole ``[batch, seq, d]`` activations, two-pass norms, rotary angles computed in
the program, keys and values repeated for grouped-query attention,
``jax.nn.dot_product_attention``, the whole batch's logits at once. It reads the fast model's
params as they are (``build_model(cfg).init``), biases and an untied head included; it has no
dropout and no LoRA adapters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainrun.config import TransformerModel
from trainrun.models.transformer import rotary_frequencies

Params = Any


def _linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return x @ p["kernel"] + p["bias"] if "bias" in p else x @ p["kernel"]


def _norm(cfg: TransformerModel, x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    if cfg.norm == "rmsnorm":
        return x / jnp.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * p["scale"]
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + cfg.norm_eps) * p["scale"] + p["bias"]


def _rotate(cfg: TransformerModel, x: jax.Array) -> jax.Array:
    """Rotary positions on ``[batch, seq, heads, head_dim]``, halves convention."""
    seq, head_dim = x.shape[1], x.shape[-1]
    # Frozen sections hash at run time; pyright reads frozen only from class keywords.
    freqs = rotary_frequencies(head_dim, cfg.rope_theta,
                               cfg.rope_scaling)  # pyright: ignore[reportArgumentType]
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
    heads, kv_heads, head_dim = cfg.heads, cfg.kv_key_heads, cfg.attention_head_dim
    embedding = params["embed"]["embedding"]
    x = embedding[tokens]
    if cfg.pad_id is not None:  # the pad token's row takes no gradient from its lookups
        x = jnp.where((tokens == cfg.pad_id)[..., None], jax.lax.stop_gradient(x), x)
    if cfg.positions == "learned":
        x = x + params["positions"][:seq][None]
    for i in range(cfg.layers):
        block = params["blocks"][str(i)]
        attn, mlp = block["attn"], block["mlp"]
        h = _norm(cfg, x, block["ln1"])
        q = _linear(h, attn["q"]).reshape(batch, seq, heads, head_dim)
        k, v = (_linear(h, attn[name]).reshape(batch, seq, kv_heads, head_dim)
                for name in ("k", "v"))
        if cfg.positions == "rope":
            q, k = _rotate(cfg, q), _rotate(cfg, k)
        k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + _linear(y.reshape(batch, seq, heads * head_dim), attn["o"])
        h = _norm(cfg, x, block["ln2"])
        if cfg.mlp == "swiglu":
            hidden = jax.nn.silu(_linear(h, mlp["gate"])) * _linear(h, mlp["up"])
        else:
            hidden = jax.nn.gelu(_linear(h, mlp["up"]), approximate=True)
        x = x + _linear(hidden, mlp["down"])
    head = params.get("head", embedding)
    return _norm(cfg, x, params["ln_f"]) @ head.T


def plain_loss(cfg: TransformerModel, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["tokens"]`` ``[batch, seq + 1]``: the same
    number the fast model's loss gives (float32 params and compute)."""
    tokens = batch["tokens"].astype(jnp.int32)
    logits = plain_logits(cfg, params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
