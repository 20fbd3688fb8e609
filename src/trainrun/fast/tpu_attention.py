"""Causal attention as Pallas' splash attention on a TPU (``tpu_splash_attention``): the
``AttentionKernel`` the transformer's ``AttentionPath`` takes in place of XLA's form.

XLA's ``dot_product_attention`` writes every layer's ``[batch, heads, seq, seq]`` float32
scores to memory and keeps the probabilities for the backward pass; splash attention
(``jax.experimental.pallas.ops.tpu.splash_attention``) computes them a block at a time in the
chip's vector memory, skips the blocks the causal mask hides, keeps only each row's
log-sum-exp, and runs its backward pass as one fused kernel. Grouped key/value heads are read
as they are, not repeated. It computes what ``models.transformer.causal_attention`` computes
(scaled logits in float32, masked, softmax, weighted values) for the inputs it takes: causal,
documents' ids or none, no sliding window, no soft-capping, a sequence of whole blocks. On a
CPU it runs in Pallas' interpreter, for tests. Block sizes: ``default_block``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.models.transformer import Segments, SharedPrefixes

LANES = 128  # the kernel's blocks are whole multiples of the chip's 128 lanes
# Blocks of 512 rows up to 1024 positions, of 1024 from 2048 on: the fastest of those measured
# on a TPU v5e at each length (BENCHMARKS.md, "TPU v5e: trainrun's step against plain JAX").
SHORT_BLOCK, LONG_BLOCK, LONG_FROM = 512, 1024, 2048
# Keys and values read with the sequence minor-most, so a 64-wide head no longer leaves half of
# the chip's 128 lanes empty (BENCHMARKS.md, "Eighth run on the chip": GPT-2 small 9% faster).
SEQ_MINOR = "kv"


def default_block(seq: int) -> int:
    """The block, in query and key rows, for a sequence of ``seq`` positions."""
    return LONG_BLOCK if seq >= LONG_FROM and seq % LONG_BLOCK == 0 else SHORT_BLOCK


@dataclasses.dataclass(frozen=True)
class SplashAttention:
    """Splash attention in blocks of ``block_q`` query rows and ``block_kv`` key rows (the
    backward pass's too; None: ``default_block`` of the sequence's length), its backward pass
    one fused kernel where ``fused_backward``. ``block_kv_compute``: the key rows of one step
    of the kernel's inner loop (None: the whole block). ``seq_minor``: which of ``"qkv"`` the
    kernel reads with the sequence, not the head's width, minor-most.
    ``interpret``: run in Pallas' interpreter (None: where the backend is not a TPU)."""

    block_q: int | None = None
    block_kv: int | None = None
    fused_backward: bool = True
    interpret: bool | None = None
    block_kv_compute: int | None = None
    seq_minor: str = SEQ_MINOR

    def blocks(self, seq: int) -> tuple[int, int]:
        """The query and key blocks at ``seq`` positions (at most the sequence)."""
        block = default_block(seq)
        return min(self.block_q or block, seq), min(self.block_kv or block, seq)

    def supports(self, q: jax.Array, k: jax.Array, segments: Segments | None,
                 window: int | None, softcap: float | None) -> bool:
        """Causal attention without a window or soft-cap, over documents' ids or none, of a
        sequence the blocks tile."""
        seq = q.shape[1]
        return (window is None and not softcap and not isinstance(segments, SharedPrefixes)
                and all(b % LANES == 0 and seq % b == 0 for b in self.blocks(seq))
                and q.shape[2] % k.shape[2] == 0)

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                 scale: float) -> jax.Array:
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as splash,
        )

        kernel = _kernel(self, q.shape[1], q.shape[2])
        # [batch, heads, seq, head_dim]; the kernel does not scale the logits, so the queries
        # are scaled first (by 1/8 for 64-wide heads: exact in any float)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q * jnp.asarray(scale, q.dtype), k, v))
        if segments is None:
            out = jax.vmap(kernel)(q, k, v)
        else:
            ids = segments.astype(jnp.int32)
            out = jax.vmap(lambda q, k, v, row: kernel(q, k, v, splash.SegmentIds(row, row)))(
                q, k, v, ids)
        return out.transpose(0, 2, 1, 3)


@functools.lru_cache(maxsize=32)
def _kernel(spec: SplashAttention, seq: int, heads: int) -> Any:
    """The splash kernel of a causal mask over ``seq`` positions for ``heads`` query heads (its
    mask's block structure is worked out once, on the host)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    bq, bkv = spec.blocks(seq)
    compute = min(spec.block_kv_compute or bkv, bkv)
    separate = None if spec.fused_backward else bq, None if spec.fused_backward else bkv
    layout = {name: splash.QKVLayout.SEQ_MINOR if name in spec.seq_minor
              else splash.QKVLayout.HEAD_DIM_MINOR for name in "qkv"}
    sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=compute,
                              block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=compute,
                              block_q_dq=separate[0], block_kv_dq=separate[1],
                              use_fused_bwd_kernel=spec.fused_backward, q_layout=layout["q"],
                              k_layout=layout["k"], v_layout=layout["v"])
    mask = masks.MultiHeadMask([masks.CausalMask((seq, seq)) for _ in range(heads)])
    interpret = jax.default_backend() != "tpu" if spec.interpret is None else spec.interpret
    # concrete arrays, not tracers of the program being traced: the kernel is cached across
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      interpret=interpret)
