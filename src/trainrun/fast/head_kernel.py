"""The head's cross-entropy forward pass as one Pallas TPU kernel (``tpu_fused_head``): the
``HeadForward`` the language-model loss's ``HeadPath`` takes.

By chunks in XLA, each chunk's float32 logits ``[chunk, vocab]`` are written to memory by
the head's matmul and read back by the reductions that follow (the log-sum-exp, the target's
logit, the first greatest logit): at a vocabulary of 50k-150k those passes over memory cost
as much as the matmul. The kernel computes a block of ``block_tokens x block_vocab`` logits in
the chip's vector memory and folds it into each token's running maximum, sum of
exponentials, target logit and first index of the maximum, so no logits reach memory. The
backward pass stays XLA's, by chunks (``losses.HeadPath``). The vocabulary is padded to whole
blocks (padded columns are masked out). Same values as ``losses._chunk_forward`` to float
rounding; on a CPU it runs in Pallas' interpreter, for tests. Block sizes: docs/internals.md,
"Fast paths".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

LANES = 128  # per-token values are kept broadcast over the chip's 128 lanes
VMEM_LIMIT = 64 * 2**20  # bytes of vector memory the kernel may use: half of what a v5e has


@dataclasses.dataclass(frozen=True)
class FusedHeadForward:
    """The kernel over blocks of ``block_tokens`` tokens and ``block_vocab`` vocabulary rows.
    ``interpret``: run in Pallas' interpreter (None: where the backend is not a TPU)."""

    block_tokens: int = 1024
    block_vocab: int = 512
    interpret: bool | None = None

    def supports(self, tokens: int, vocab: int, d_model: int) -> bool:
        """Tokens in whole blocks (of at least 8 rows), lane-wide vocabulary blocks and a
        lane-wide model width."""
        block = min(self.block_tokens, tokens)
        return (tokens % block == 0 and block % 8 == 0 and self.block_vocab % LANES == 0
                and d_model % LANES == 0)

    def __call__(self, features: jax.Array, table: jax.Array, targets: jax.Array,
                 softcap: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per token: the log-sum-exp of its logits (float32), its loss (0 where the target is
        -1) and whether its first greatest logit is its target."""
        return _fused_forward(features, table, targets, self, softcap)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _fused_forward(features: jax.Array, table: jax.Array, targets: jax.Array,
                   spec: FusedHeadForward, softcap: float | None
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    tokens, d_model = features.shape
    vocab = table.shape[0]
    bt, bv = min(spec.block_tokens, tokens), spec.block_vocab
    blocks = -(-vocab // bv)
    if blocks * bv != vocab:  # whole blocks; the padded rows are masked in the kernel
        table = jnp.pad(table, ((0, blocks * bv - vocab), (0, 0)))
    wide = jnp.broadcast_to(targets.astype(jnp.int32)[:, None], (tokens, LANES))
    row = pl.BlockSpec((bt, LANES), lambda i, j: (i, 0))
    kernel = functools.partial(_kernel, vocab=vocab, block_vocab=bv, softcap=softcap)
    interpret = jax.default_backend() != "tpu" if spec.interpret is None else spec.interpret
    lse, picked, first = pl.pallas_call(
        kernel,
        grid=(tokens // bt, blocks),
        in_specs=[pl.BlockSpec((bt, d_model), lambda i, j: (i, 0)),
                  pl.BlockSpec((bv, d_model), lambda i, j: (j, 0)), row],
        out_specs=[row, row, row],
        out_shape=[jax.ShapeDtypeStruct((tokens, LANES), jnp.float32)] * 3,
        scratch_shapes=[pltpu.VMEM((bt, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
    )(features, table, wide)
    lse, picked, first = lse[:, 0], picked[:, 0], first[:, 0]
    valid = targets >= 0
    loss = jnp.where(valid, lse - picked, 0.0)
    hit = valid & (first == targets.astype(jnp.float32))
    return lse, loss, hit


def _kernel(x_ref, w_ref, target_ref, lse_ref, picked_ref, first_ref, sum_ref, *,
            vocab: int, block_vocab: int, softcap: float | None) -> None:
    """One block of logits folded into the running maximum (``lse_ref`` until the last block),
    sum of exponentials (``sum_ref``), target logit and first index of the maximum (as a
    float: exact below 2**24). Per-token values are ``[block_tokens, LANES]``, every lane the
    same, and are tiled across a block's columns (splash attention's layout)."""
    from jax.experimental import pallas as pl

    j = pl.program_id(1)

    @pl.when(j == 0)
    def _start() -> None:
        lse_ref[...] = jnp.full_like(lse_ref, -jnp.inf)
        sum_ref[...] = jnp.zeros_like(sum_ref)
        picked_ref[...] = jnp.zeros_like(picked_ref)
        first_ref[...] = jnp.zeros_like(first_ref)

    logits = jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [bt, bv]
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    repeats = block_vocab // LANES
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) + j * block_vocab
    logits = jnp.where(column < vocab, logits, -jnp.inf)
    lanes = lse_ref.shape

    def per_token(row_values: jax.Array) -> jax.Array:  # [bt] -> [bt, LANES]
        return jax.lax.broadcast_in_dim(row_values, lanes, (0,))

    def across(values: jax.Array) -> jax.Array:  # [bt, LANES] -> [bt, bv]
        return jnp.tile(values, (1, repeats))

    block_max = per_token(logits.max(axis=-1))
    block_first = per_token(jnp.where(logits == across(block_max),
                                      column.astype(jnp.float32), jnp.inf).min(axis=-1))
    block_picked = per_token(jnp.where(column == across(target_ref[...]), logits,
                                       0.0).sum(axis=-1))
    running = lse_ref[...]
    new_max = jnp.maximum(running, block_max)
    block_sum = per_token(jnp.exp(logits - across(new_max)).sum(axis=-1))
    sum_ref[...] = sum_ref[...] * jnp.exp(running - new_max) + block_sum
    first_ref[...] = jnp.where(block_max > running, block_first, first_ref[...])
    picked_ref[...] = picked_ref[...] + block_picked
    lse_ref[...] = new_max

    @pl.when(j == pl.num_programs(1) - 1)
    def _end() -> None:
        lse_ref[...] = lse_ref[...] + jnp.log(sum_ref[...])
