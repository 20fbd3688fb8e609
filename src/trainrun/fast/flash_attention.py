"""Causal attention as a flash kernel whose backward is deterministic by construction: JAX's
Pallas attention for GPUs (``jax.experimental.pallas.ops.gpu.attention``, lowered through
Triton). Its backward pass computes each block of dK and dV, and each block of dQ, in one
program instance that loops over the other sequence: no atomic adds, so the gradient is bitwise
the same on every run without XLA's deterministic mode, which gives up cuDNN's attention.

It computes what ``models.transformer.causal_attention`` computes (scaled logits in float32,
the causal and segment masks, softmax, weighted values) for what the kernel takes: no sliding
window and no logit soft-capping. The sequence is padded to a multiple of the block (padded keys
come after every query, so the causal mask hides them) and grouped key/value heads are repeated
to the query heads. On a CPU it runs in Pallas' interpret mode, for tests.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

BLOCK = 128  # rows of queries and of keys per block of the forward kernel
BACKWARD_BLOCK = 32  # rows per block of the backward kernel (its default)


def supports(window: int | None, softcap: float | None) -> bool:
    """Whether the kernel computes an attention with this window and soft-capping."""
    return window is None and not softcap


def flash_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                           segments: jax.Array | None = None, *, scale: float | None = None,
                           block: int = BLOCK, backward_block: int = BACKWARD_BLOCK,
                           interpret: bool | None = None) -> jax.Array:
    """Causal self-attention of ``[batch, seq, heads, head_dim]`` queries and ``[batch, seq,
    kv_heads, head_dim]`` keys and values, ``kv_heads`` dividing ``heads``.

    segments: ``[batch, seq]`` ids of the documents packed in each row (None: one per row).
    scale: of the logits (None: ``1 / sqrt(head_dim)``). interpret: run the kernel in Pallas'
    interpreter (None: where the backend is not a GPU).
    """
    from jax.experimental.pallas.ops.gpu import attention

    batch, seq, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    if groups > 1:  # the kernel takes as many key/value heads as query heads
        k, v = (jnp.repeat(t, groups, axis=2) for t in (k, v))
    step = min(block, _round_up(seq, backward_block))
    padded = _round_up(seq, step)
    if padded != seq:
        pad = ((0, 0), (0, padded - seq), (0, 0), (0, 0))
        q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
        if segments is not None:
            segments = jnp.pad(segments, ((0, 0), (0, padded - seq)), constant_values=-1)
    back = min(backward_block, step)
    sizes = attention.BlockSizes(block_q=step, block_k=step, block_q_dkv=back,
                                 block_kv_dkv=back, block_q_dq=back, block_kv_dq=back)
    out: jax.Array = attention.mha(  # pyright: ignore[reportAssignmentType]
        q, k, v, None if segments is None else segments.astype(jnp.int32),
        sm_scale=1.0 / math.sqrt(head_dim) if scale is None else scale, causal=True,
        block_sizes=sizes,
        interpret=jax.default_backend() != "gpu" if interpret is None else interpret)
    return out[:, :seq].reshape(batch, seq, heads, head_dim)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
