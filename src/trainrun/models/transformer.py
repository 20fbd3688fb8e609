"""A decoder-only transformer language model as a Flax NNX module: GPT-2's layout and the
Llama family's (Llama, Qwen2, Mistral) from one set of blocks.

    tokens ─► embed (+ learned positions) ─► dropout
           ─► L x [ x + drop(attn(norm(x)))  ;  x + drop(mlp(norm(x))) ]     pre-norm
           ─► norm ─► logits = x @ head.T          head: the embedding table, or its own

norm: LayerNorm or RMSNorm; mlp: GELU, or SwiGLU (``down(silu(gate(x)) * up(x))``); attention:
causal, with as many key/value heads as query heads or fewer (grouped-query), rotary positions
(base ``rope_theta``, optionally scaled) or learned ones. Dropout comes from the step key; the
same blocks run with a key/value cache for decoding (``prefill`` / ``decode``). Written for
XLA:CPU's speed without changing the maths, each param naming its dimensions for the sharding
rules: docs/internals.md, "The transformer".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trainrun.config import RopeScaling, TransformerModel
from trainrun.models.adapters import Model, bind_params, from_nnx
from trainrun.models.experts import Experts, RouterStats, load_balancing_loss
from trainrun.models.lora import LoRA
from trainrun.models.losses import (
    LN2,
    PLAIN_HEAD,
    HeadPath,
    next_token_from_features,
    softcapped,
    tied_head_logits,
)
from trainrun.models.matmul import float32_dot

PyTree = Any


class SharedPrefixes(NamedTuple):
    """Packed rows whose sequences may share a prefix (a preference pair's chosen and
    rejected answer after one prompt), ``[batch, seq]`` each: ``group``, the id of the
    sequences sharing a prefix (0: padding); ``branch``, 0 on the group's shared prefix and
    ``b > 0`` on the tokens of its sequence ``b``; ``position``, each token's position in its
    sequence. A token attends to the earlier tokens of its group that are the prefix's or its
    own sequence's, and a sliding window counts positions, not slots: a later sequence's
    tokens lie further from the prefix in the row than in their sequence."""

    group: jax.Array
    branch: jax.Array
    position: jax.Array


Segments = jax.Array | SharedPrefixes  # documents' ids, or groups sharing a prefix


def same_segment(segments: Segments, rows: slice, keys: slice,
                 window: int | None = None) -> jax.Array:
    """``[batch, rows, keys]``: whether each query row may see each key by its segment (the
    causal mask aside): the same document, or a shared prefix's or its own sequence's token,
    within ``window`` positions of it where given."""
    if isinstance(segments, SharedPrefixes):
        group, branch, position = segments
        mine, theirs = branch[:, rows, None], branch[:, None, keys]
        same = ((group[:, rows, None] == group[:, None, keys])
                & ((theirs == 0) | (theirs == mine)))
        if window is not None:
            same = same & (position[:, rows, None] - position[:, None, keys] < window)
        return same
    return segments[:, rows, None] == segments[:, None, keys]


class KV(NamedTuple):
    """One layer's key/value cache: ``[batch, kv_heads, max_len, head_dim]`` each."""

    k: jax.Array
    v: jax.Array


class Rope(NamedTuple):
    """Rotary position angles for the positions of a chunk: ``[chunk, head_dim // 2]`` each."""

    # numpy when the positions are static: a constant in the program (Transformer.features)
    sin: jax.Array | np.ndarray
    cos: jax.Array | np.ndarray

    @classmethod
    def at(cls, positions: jax.Array, freqs: np.ndarray) -> Rope:
        """The angles ``position x frequency`` (``freqs``: ``rotary_frequencies``) of positions
        ``[chunk]``, or ``[batch, chunk]`` for rows of their own positions."""
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
        return cls(jnp.sin(angles), jnp.cos(angles))

    def apply(self, x: jax.Array) -> jax.Array:  # x: [batch, chunk, heads, head_dim]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        # The tables in x's dtype: float32 tables would promote bfloat16 queries and keys, and
        # with them every matmul downstream, to float32.
        # [chunk, half] tables, or [batch, chunk, half] for per-token positions (packed rows).
        sin, cos = (jnp.asarray(t, x.dtype)[..., None, :] for t in (self.sin, self.cos))
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


# One program for a table's angles, sines and cosines, where computing them an op at a time
# compiled six programs for every new length (a first lm-eval command traces several lengths).
_rope_table = jax.jit(lambda positions, freqs: Rope.at(positions, freqs))


@functools.lru_cache(maxsize=64)
def _static_rope(start: int, chunk: int, rotary: tuple[Any, ...]) -> Rope:
    """The rotary table of positions ``start`` to ``start + chunk`` as NumPy constants, for a
    program whose positions are static; computed by XLA as the in-program table is."""
    with jax.ensure_compile_time_eval():
        angles = _rope_table(np.arange(start, start + chunk, dtype=np.int32),
                             rotary_frequencies(*rotary))
    return Rope(*(np.asarray(t) for t in angles))


@functools.lru_cache(maxsize=16)
def rotary_frequencies(head_dim: int, theta: float = 10_000.0,
                       scaling: RopeScaling | None = None) -> np.ndarray:
    """The ``head_dim // 2`` rotary frequencies ``theta ** (-2i / head_dim)`` (float32), as
    ``scaling`` stretches them: ``linear`` divides all by its factor; ``llama3`` divides those
    whose wavelength exceeds ``original_max_positions / low_freq_factor``, keeps those under
    ``original_max_positions / high_freq_factor`` and blends linearly in wavelength between
    (Llama 3.1's rule, as ``transformers`` computes it)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    freqs = freqs.astype(np.float32)
    if scaling is None:
        return freqs
    if scaling.type == "linear":
        return (freqs / np.float32(scaling.factor)).astype(np.float32)
    old = scaling.original_max_positions
    wavelength = 2 * math.pi / freqs
    low_wavelength = old / scaling.low_freq_factor  # longer than this: slowed by factor
    high_wavelength = old / scaling.high_freq_factor  # shorter than this: kept
    scaled = np.where(wavelength > low_wavelength, freqs / scaling.factor, freqs)
    smooth = ((old / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    between = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return np.where(between, blended, scaled).astype(np.float32)


ATTENTION_BLOCK = 64  # query rows per block of causal attention on CPU (docs/internals.md)


class AttentionKernel(Protocol):
    """A kernel computing ``causal_attention`` (``fast/tpu_attention.py``) for the inputs it
    ``supports``: ``[batch, seq, heads, head_dim]`` queries, ``[batch, seq, kv_heads,
    head_dim]`` keys and values (grouped-query heads as they are), documents' ids or None.
    Hashable: it is part of a compiled program's static description."""

    def supports(self, q: jax.Array, k: jax.Array, segments: Segments | None,
                 window: int | None, softcap: float | None) -> bool: ...

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                 scale: float) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class AttentionPath:
    """How ``causal_attention`` computes (never what): ``block``, query rows per block on CPU
    and with a soft-cap; ``fused_gpu``, cuDNN's fused (flash) attention on an NVIDIA GPU in
    bfloat16 or float16; ``kernel``, a kernel of its own for the inputs it supports (a TPU's
    splash attention). The plain path is the default; ``fast/strategies.py`` chooses another
    once per run or command."""

    block: int = ATTENTION_BLOCK
    fused_gpu: bool = False
    kernel: AttentionKernel | None = None


PLAIN_ATTENTION = AttentionPath()


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     segments: Segments | None = None, *, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None,
                     path: AttentionPath = AttentionPath()) -> jax.Array:
    """Causal self-attention of ``[batch, seq, heads, head_dim]`` queries, keys and values: the
    maths of ``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` (scaled logits in
    float32, masked to a large negative number, softmax, weighted sum of values).

    segments: ``[batch, seq]`` ids of the documents packed in each row: a token then attends
    only to earlier tokens of its own segment, on every path below (padding, segment 0, attends
    to padding); or ``SharedPrefixes``, sequences sharing a prefix. None: the plain causal
    program.
    scale: of the logits (None: ``1 / sqrt(head_dim)``). window: a token attends to the last
    ``window`` positions, its own included (a sliding window; None: to every earlier one).
    softcap: the scaled logits become ``softcap * tanh(logits / softcap)`` before the mask
    (``softcapped``; None: as they are). path: how it is computed (``AttentionPath``).

    On CPU, and on every backend with ``softcap`` (which ``dot_product_attention`` does not
    compute), it runs head-major and in blocks of ``path.block`` query rows, each block against
    only the keys up to its own last row: XLA:CPU then skips most of the masked upper triangle
    (3/8 of the attention work at seq 256) and its batched matmuls need no transposes. On an
    NVIDIA GPU in bfloat16 or float16 with ``path.fused_gpu`` it is cuDNN's fused (flash)
    attention, which JAX does not pick by itself; elsewhere ``dot_product_attention``'s XLA
    form. With ``path.kernel``, that kernel where it supports the inputs. Keys and values may
    have fewer heads than the queries (grouped-query attention): each serves
    ``heads // kv_heads`` query heads in a row.
    """
    if path.kernel is not None and path.kernel.supports(q, k, segments, window, softcap):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        assert not isinstance(segments, SharedPrefixes)  # the kernel said it supports them
        return path.kernel(q, k, v, segments, scale)
    group = q.shape[2] // k.shape[2]  # query heads sharing a key/value head
    if group > 1:
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    backend = jax.default_backend()
    # the window of rows of shared prefixes is in their positions (SharedPrefixes), not slots
    by_position = window if isinstance(segments, SharedPrefixes) else None
    by_slot = None if by_position else window
    local = None if by_slot is None else (by_slot - 1, 0)  # slots before and after a query
    if backend != "cpu" and softcap is None:
        every = slice(None)
        same = (None if segments is None else
                same_segment(segments, every, every, by_position)[:, None])  # [batch, 1, q, k]
        if path.fused_gpu and backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
            # cuDNN takes the segment mask as JAX passes it any mask: an additive bias [batch,
            # 1, seq, seq] beside its own causal mask. (Its packed layout of segment offsets is
            # reached only through JAX's private API.) Where it refuses, the XLA form masks.
            try:
                return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True,
                                                    scale=scale, local_window_size=local,
                                                    implementation="cudnn")
            except (NotImplementedError, RuntimeError, ValueError):  # no cuDNN, or a shape
                pass
        return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True, scale=scale,
                                            local_window_size=local)
    seq = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [batch, heads, seq, head_dim]
    masked = jnp.asarray(-0.7 * float(jnp.finfo(jnp.float32).max), jnp.float32)
    blocks = []
    for lo in range(0, seq, path.block):
        hi = min(lo + path.block, seq)
        first = 0 if by_slot is None else max(0, lo - by_slot + 1)  # keys any row here sees
        logits = float32_dot(q[:, :, lo:hi], k[:, :, first:hi],
                             (((3,), (3,)), ((0, 1), (0, 1)))) * jnp.float32(scale)
        logits = softcapped(logits, softcap)
        keys, rows = jnp.arange(first, hi)[None, :], jnp.arange(lo, hi)[:, None]
        visible = keys <= rows
        if by_slot is not None:
            visible = visible & (keys > rows - by_slot)
        if segments is not None:  # [batch, 1, block rows, keys]
            visible = visible & same_segment(segments, slice(lo, hi), slice(first, hi),
                                             by_position)[:, None]
        probs = jax.nn.softmax(jnp.where(visible, logits, masked), axis=-1)
        blocks.append(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype),
                                 v[:, :, first:hi]))
    return jnp.concatenate(blocks, axis=2).transpose(0, 2, 1, 3)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, *,
                     scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """Attention of ``[batch, chunk, heads, head_dim]`` queries to a cache's ``[batch,
    kv_heads, slots, head_dim]`` keys and values, each query to the slots ``visible``
    (``[batch or 1, chunk, slots]``) marks; grouped-query attention as
    ``dot_product_attention`` takes it (query head ``h`` reads key/value head ``h // (heads //
    kv_heads)``), and its maths (scaled logits in float32, masked, softmax, weighted values);
    with ``softcap`` the scaled logits are soft-capped first (``softcapped``).

    The cache is head-major so that both products are batched over (batch, key/value head)
    with no copy of the cache into another layout at each decoded token."""
    batch, chunk, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    # [batch, kv_heads, group * chunk, head_dim]: a key/value head's queries side by side
    grouped = (q.reshape(batch, chunk, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
               .reshape(batch, kv_heads, group * chunk, head_dim))
    logits = jax.lax.dot_general(grouped, k, (((3,), (3,)), ((0, 1), (0, 1))),
                                 preferred_element_type=jnp.float32) * jnp.float32(scale)
    logits = softcapped(logits, softcap).reshape(batch, kv_heads, group, chunk, -1)
    masked = jnp.asarray(-0.7 * float(jnp.finfo(jnp.float32).max), jnp.float32)
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], logits, masked), axis=-1)
    y = jax.lax.dot_general(probs.astype(v.dtype).reshape(batch, kv_heads, group * chunk, -1), v,
                            (((3,), (2,)), ((0, 1), (0, 1))))
    return (y.reshape(batch, kv_heads, group, chunk, head_dim).transpose(0, 3, 1, 2, 4)
            .reshape(batch, chunk, heads, head_dim))


def _linear(d_in: int, d_out: int, axes: tuple[str, str], std: float, rngs: nnx.Rngs,
            bias: bool = False) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=bias, rngs=rngs,
                      kernel_init=nnx.initializers.normal(std), kernel_metadata={"axes": axes},
                      bias_metadata={"axes": axes[1:]})


def _adapter(name: str, d_in: int, d_out: int, axes: tuple[str, str], cfg: TransformerModel,
             experts: int | None = None) -> LoRA | None:
    return (LoRA(d_in, d_out, cfg.lora, axes, experts)
            if cfg.lora is not None and name in cfg.adapted else None)


ADAPTER_STREAM = 0x4C6F5241  # "LoRA": the adapters' draws, folded off the init key


def adapter_draws(key: jax.Array, shapes: dict[str, tuple[int, ...]]) -> jax.Array:
    """The ``A`` of every adapter, ``shapes`` by the adapter's dotted name, as one float32
    vector: the names in sorted order, each ``[experts,] d_in x rank`` values ~ N(0, 1/d_in),
    all from one standard normal draw of ``fold_in(key, ADAPTER_STREAM)``. One sampler whatever
    the depth, so a fine-tune from a model directory, which draws its adapters alone, compiles
    a program that does not grow with the layers (BENCHMARKS.md, "LoRA against full
    fine-tuning")."""
    names = sorted(shapes)
    sizes = [math.prod(shapes[name]) for name in names]
    scale = np.repeat(np.asarray([1.0 / math.sqrt(shapes[name][-2]) for name in names],
                                 np.float32), sizes)
    normal = jax.random.normal(jax.random.fold_in(key, ADAPTER_STREAM), (sum(sizes),),
                               jnp.float32)
    return normal * scale


def split_adapters(draws: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``adapter_draws``' vector (a JAX or NumPy array) cut into each adapter's ``A``."""
    pieces, at = {}, 0
    for name in sorted(shapes):
        size = math.prod(shapes[name])
        pieces[name] = draws[at:at + size].reshape(shapes[name])
        at += size
    return pieces


def _project(layer: nnx.Linear, adapter: LoRA | None, x: jax.Array) -> jax.Array:
    return layer(x) if adapter is None else layer(x) + adapter(x)


def _project_fused(layers: Sequence[nnx.Linear], adapter: LoRA | None, x: jax.Array
                   ) -> list[jax.Array]:
    """Linear layers that read the same ``x`` and are one layer in the model's family (Phi-3's
    qkv_proj, gate_up_proj), with one adapter over their outputs side by side."""
    out = [layer(x) for layer in layers]
    if adapter is None:
        return out
    delta = adapter(x)
    cuts = np.cumsum([y.shape[-1] for y in out])[:-1].tolist()
    return [y + part for y, part in zip(out, jnp.split(delta, cuts, axis=-1), strict=True)]


def _project_each(pairs: Sequence[tuple[nnx.Linear, LoRA | None]], x: jax.Array
                  ) -> list[jax.Array]:
    """Linear layers that read the same ``x``, each with its adapter or none: the adapters'
    ``A`` matrices applied in one matmul (a small model's LoRA step is bound by its op count;
    BENCHMARKS.md, "LoRA against full fine-tuning")."""
    adapters = [adapter for _, adapter in pairs if adapter is not None]
    if len(adapters) < 2:
        return [_project(layer, adapter, x) for layer, adapter in pairs]
    low = x @ jnp.concatenate([adapter.scaled_a() for adapter in adapters], axis=1)
    out, at = [], 0
    for layer, adapter in pairs:
        if adapter is None:
            out.append(layer(x))
            continue
        rank = adapter.a.shape[1]
        out.append(layer(x) + low[:, at:at + rank] @ adapter.b[...])
        at += rank
    return out


class RMSNormPlusOne(nnx.Module):
    """RMSNorm scaling by ``1 + w`` (``w`` from zero), computed in float32 and cast back to the
    input's dtype, as Gemma's checkpoints expect."""

    def __init__(self, dim: int, eps: float, axes: tuple[str | None, ...]):
        self.scale = nnx.Param(jnp.zeros((dim,)), axes=axes)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def _rms_norm(cfg: TransformerModel, dim: int, axes: tuple[str | None, ...],
              rngs: nnx.Rngs) -> nnx.RMSNorm | RMSNormPlusOne:
    if cfg.norm_plus_one:
        return RMSNormPlusOne(dim, cfg.norm_eps, axes)
    return nnx.RMSNorm(dim, epsilon=cfg.norm_eps, rngs=rngs, scale_metadata={"axes": axes})


def _norm(cfg: TransformerModel, rngs: nnx.Rngs) -> nnx.LayerNorm | nnx.RMSNorm | RMSNormPlusOne:
    if cfg.norm == "rmsnorm":
        return _rms_norm(cfg, cfg.d_model, ("embed",), rngs)
    return nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, rngs=rngs,
                         scale_metadata={"axes": ("embed",)}, bias_metadata={"axes": ("embed",)})


class Attention(nnx.Module):
    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs, window: int | None = None,
                 path: AttentionPath = AttentionPath()):
        d, std = cfg.d_model, cfg.init_std
        self.heads, self.kv_heads = cfg.heads, cfg.kv_key_heads
        self.head_dim = cfg.attention_head_dim
        self.scale, self.window, self.path = cfg.query_scale, window, path
        self.softcap = cfg.attention_logit_softcap
        inner, kv_inner = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attention_bias
        self.q = _linear(d, inner, ("embed", "heads"), std, rngs, qkv_bias)
        self.k = _linear(d, kv_inner, ("embed", "heads"), std, rngs, qkv_bias)
        self.v = _linear(d, kv_inner, ("embed", "heads"), std, rngs, qkv_bias)
        # Residual projections start smaller, so the residual stream's variance does not grow
        # with depth (GPT-2).
        self.o = _linear(inner, d, ("heads", "embed"), std / math.sqrt(2 * cfg.layers), rngs,
                         cfg.bias or cfg.attention_bias)
        # qk_norm over each head, or over the whole q and k projections (their heads together)
        self.qk_norm_over = cfg.qk_norm_over
        whole = cfg.qk_norm_over == "projection"
        widths = (inner, kv_inner) if whole else (self.head_dim, self.head_dim)
        self.q_norm, self.k_norm = ((_rms_norm(cfg, width, ("heads",) if whole else (None,),
                                               rngs) if cfg.qk_norm else None)
                                    for width in widths)
        fused = cfg.fused_projections
        # fused: one adapter over q, k and v side by side (Phi-3's qkv_proj)
        self.qkv_lora = (_adapter("q", d, inner + 2 * kv_inner, ("embed", "heads"), cfg)
                         if fused else None)
        self.q_lora = None if fused else _adapter("q", d, inner, ("embed", "heads"), cfg)
        self.k_lora, self.v_lora = (None if fused else
                                    _adapter(name, d, kv_inner, ("embed", "heads"), cfg)
                                    for name in "kv")
        self.o_lora = _adapter("o", inner, d, ("heads", "embed"), cfg)

    def __call__(self, x: jax.Array, rope: Rope | None, cache: KV | None = None,
                 pos: jax.Array | int = 0, segments: Segments | None = None,
                 start: jax.Array | None = None) -> tuple[jax.Array, KV | None]:
        """x: ``[batch, chunk, d_model]`` at cache slots ``pos ..``. Without a cache the chunk
        attends to itself causally (training; within each of ``segments`` when given); with
        one, its keys/values are written into the cache at ``pos`` and it attends to every
        cached slot up to its own, from each row's ``start`` (``[batch]``: the slots before
        it hold a shorter prompt's left padding) when given."""
        b, c, d = x.shape
        rows = x.reshape(b * c, d)  # 2-D matmuls: see MLP.__call__
        projected = (_project_fused((self.q, self.k, self.v), self.qkv_lora, rows)
                     if self.qkv_lora is not None else
                     _project_each(((self.q, self.q_lora), (self.k, self.k_lora),
                                    (self.v, self.v_lora)), rows))
        whole = self.qk_norm_over == "projection"
        if whole and self.q_norm is not None and self.k_norm is not None:
            projected = [self.q_norm(projected[0]), self.k_norm(projected[1]), projected[2]]
        q, k, v = (y.reshape(b, c, heads, self.head_dim) for y, heads in zip(
            projected, (self.heads, self.kv_heads, self.kv_heads), strict=True))
        if not whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope.apply(q), rope.apply(k)
        if cache is None:
            y = causal_attention(q, k, v, segments, scale=self.scale, window=self.window,
                                 softcap=self.softcap, path=self.path)
        else:
            cache = KV(*(jax.lax.dynamic_update_slice(kept, new.transpose(0, 2, 1, 3),
                                                      (0, 0, pos, 0))
                         for kept, new in ((cache.k, k), (cache.v, v))))
            keys, rows = jnp.arange(cache.k.shape[2])[None, :], pos + jnp.arange(c)[:, None]
            visible = (keys <= rows)[None]
            if self.window is not None:
                visible = visible & (keys > rows - self.window)
            if start is not None:
                visible = visible & (keys >= start[:, None, None])
            y = cached_attention(q, cache.k, cache.v, visible, scale=self.scale,
                                 softcap=self.softcap)
        y = y.reshape(b * c, self.heads * self.head_dim)
        return _project(self.o, self.o_lora, y).reshape(b, c, d), cache


class MLP(nnx.Module):
    """GELU (``down(gelu(up(x)))``), SwiGLU (``down(silu(gate(x)) * up(x))``) or GeGLU (the
    same with tanh-approximated GELU for silu). The dense layers of a mixture of experts carry
    no adapters (``TransformerModel.adapted``)."""

    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs):
        d, hidden = cfg.d_model, cfg.hidden
        bias = cfg.bias or cfg.mlp_bias
        self.kind = cfg.mlp
        self.up = _linear(d, hidden, ("embed", "mlp"), cfg.init_std, rngs, bias)
        self.down = _linear(hidden, d, ("mlp", "embed"),
                            cfg.init_std / math.sqrt(2 * cfg.layers), rngs, bias)
        self.gate = (_linear(d, hidden, ("embed", "mlp"), cfg.init_std, rngs, bias)
                     if cfg.gated else None)
        own = cfg.experts is None  # a mixture's dense layers: none
        fused = cfg.fused_projections and cfg.gated
        self.up_lora = (_adapter("up", d, hidden, ("embed", "mlp"), cfg)
                        if own and not fused else None)
        self.down_lora = _adapter("down", hidden, d, ("mlp", "embed"), cfg) if own else None
        self.gate_lora = (_adapter("gate", d, hidden, ("embed", "mlp"), cfg)
                          if own and not fused else None)
        # fused: one adapter over gate and up side by side (Phi-3's gate_up_proj)
        self.gate_up_lora = (_adapter("gate", d, 2 * hidden, ("embed", "mlp"), cfg)
                             if own and fused else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        # On [tokens, d_model] rows rather than [batch, seq, d_model]: the weight gradients are
        # then plain 2-D matmuls, where XLA:CPU would otherwise write the GELU gradient
        # transposed for them (a strided pass over the 4 x d_model wide activations).
        rows = x.reshape(-1, x.shape[-1])
        if self.gate is not None:
            gate, up = (_project_fused((self.gate, self.up), self.gate_up_lora, rows)
                        if self.gate_up_lora is not None else
                        _project_each(((self.gate, self.gate_lora), (self.up, self.up_lora)),
                                      rows))
            gate = (jax.nn.silu(gate) if self.kind == "swiglu"
                    else jax.nn.gelu(gate, approximate=True))
            hidden = gate * up
        else:
            hidden = jax.nn.gelu(_project(self.up, self.up_lora, rows), approximate=True)
        return _project(self.down, self.down_lora, hidden).reshape(x.shape)


class Block(nnx.Module):
    """One layer: ``x + drop(attn(ln1(x)))`` then ``x + drop(mlp(ln2(x)))``; with
    ``post_norms`` each sublayer's output is normed before it is added (Gemma); without
    ``pre_norms`` each sublayer reads ``x`` itself, unnormed (OLMo-2, with post_norms)."""

    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs, index: int = 0,
                 attention: AttentionPath = AttentionPath()):
        self.ln1 = _norm(cfg, rngs) if cfg.pre_norms else None
        self.attn = Attention(cfg, rngs, cfg.sliding_window if cfg.local_layer(index) else None,
                              attention)
        self.ln2 = _norm(cfg, rngs) if cfg.pre_norms else None
        self.mlp = Experts(cfg, rngs) if cfg.expert_layer(index) else MLP(cfg, rngs)
        self.drop = nnx.Dropout(cfg.dropout)
        self.attn_out_norm = _norm(cfg, rngs) if cfg.post_norms else None
        self.mlp_out_norm = _norm(cfg, rngs) if cfg.post_norms else None

    def __call__(self, x: jax.Array, rope: Rope | None, key: jax.Array | None,
                 cache: KV | None = None, pos: jax.Array | int = 0,
                 segments: Segments | None = None, start: jax.Array | None = None,
                 ) -> tuple[jax.Array, KV | None, RouterStats | None]:
        """The layer's output, its updated cache, and its router's statistics (a mixture of
        experts; else None)."""
        y, cache = self.attn(_normed(self.ln1, x), rope, cache, pos, segments, start)
        if self.attn_out_norm is not None:
            y = self.attn_out_norm(y)
        x = x + _dropout(self.drop, y, key, 0)
        stats = None
        if isinstance(self.mlp, Experts):
            y, stats = self.mlp(_normed(self.ln2, x))
        else:
            y = self.mlp(_normed(self.ln2, x))
        if self.mlp_out_norm is not None:
            y = self.mlp_out_norm(y)
        x = x + _dropout(self.drop, y, key, 1)
        return x, cache, stats


def _normed(norm: nnx.LayerNorm | nnx.RMSNorm | RMSNormPlusOne | None, x: jax.Array
            ) -> jax.Array:
    """``norm(x)``, or ``x`` where the layer has no such norm."""
    return x if norm is None else norm(x)


def _dropout(layer: nnx.Dropout, x: jax.Array, key: jax.Array | None, site: int) -> jax.Array:
    """Dropout with its own key per site; off without a key (eval, decoding)."""
    if key is None:
        return x
    return layer(x, deterministic=False, rngs=jax.random.fold_in(key, site))


REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: recompute it whole in the backward pass
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Transformer(nnx.Module):
    """The decoder-only transformer ``cfg`` describes. ``attention``: how its causal attention
    is computed (``AttentionPath``); it changes how, not what, the model computes."""

    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs,
                 attention: AttentionPath = AttentionPath()):
        self.layers, self.kv_heads = cfg.layers, cfg.kv_key_heads
        self.head_dim = cfg.attention_head_dim
        self.rotary = (self.head_dim, cfg.rope_theta, cfg.rope_scaling)  # rotary_frequencies
        # Layers with a rotary scheme of their own (Gemma 3's local ones): their frequencies.
        self.local_rotary = (None if cfg.local_rope_theta is None else
                             (self.head_dim, cfg.local_rope_theta, None))
        self.own_rotary = tuple(self.local_rotary is not None and cfg.local_layer(i)
                                for i in range(cfg.layers))
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None
        self.pad_id = cfg.pad_id
        self.final_softcap = cfg.final_logit_softcap
        self.scan_layers, self.remat = cfg.scan_layers, cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs,
                               embedding_init=nnx.initializers.normal(cfg.init_std),
                               embedding_metadata={"axes": ("vocab", "embed")})
        self.positions = (nnx.Param(nnx.initializers.normal(cfg.init_std)(
            rngs.params(), (cfg.seq_len, cfg.d_model)), axes=(None, "embed"))
            if cfg.positions == "learned" else None)
        self.blocks = nnx.Dict({f"{i}": Block(cfg, rngs, i, attention)
                                for i in range(cfg.layers)})
        self.ln_f = _norm(cfg, rngs)
        self.drop = nnx.Dropout(cfg.dropout)
        # An output head of its own, [vocab, d_model] as the embedding table (and as
        # transformers stores lm_head); created last, so a tied model draws the same init.
        self.head = (None if cfg.tie_embeddings else nnx.Param(
            nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.vocab, cfg.d_model)),
            axes=("vocab", "embed")))
        if cfg.lora is not None:  # off a stream of their own: the base params are the same
            adapters = {".".join(map(str, path)): node for path, node in nnx.iter_graph(self)
                        if isinstance(node, LoRA)}
            shapes = {name: tuple(adapter.a.shape) for name, adapter in adapters.items()}
            drawn = split_adapters(adapter_draws(rngs.params.key[...], shapes), shapes)
            for name, adapter in adapters.items():
                adapter.a[...] = drawn[name]

    def head_table(self) -> jax.Array:
        """The ``[vocab, d_model]`` table the final features are multiplied by."""
        return self.embed.embedding[...] if self.head is None else self.head[...]

    def head_logits(self, features: jax.Array) -> jax.Array:
        """The float32 logits ``[tokens, vocab]`` of the final features ``[tokens,
        d_model]``: times the head's table, soft-capped where ``final_logit_softcap`` says."""
        return softcapped(tied_head_logits(features, self.head_table()), self.final_softcap)

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None,
                 cache: list[KV] | None = None,
                 pos: jax.Array | int = 0) -> tuple[jax.Array, list[KV] | None]:
        """Logits ``[batch, chunk, vocab]`` (float32) for ``tokens`` ``[batch, chunk]`` at
        positions ``pos ..``. ``key``: dropout randomness (None: no dropout). ``cache``: one
        ``KV`` per layer for decoding, returned updated; None for training."""
        batch, chunk = tokens.shape
        x, new_cache = self.features(tokens, key, cache, pos)
        return self.head_logits(x).reshape(batch, chunk, -1), new_cache

    def last_logits(self, tokens: jax.Array, cache: list[KV], pos: jax.Array | int = 0,
                    start: jax.Array | None = None, head_columns: jax.Array | None = None,
                    ) -> tuple[jax.Array, list[KV]]:
        """Decoding: the logits ``[batch, vocab]`` (float32) after the last of ``tokens``
        ``[batch, chunk]`` written into ``cache`` at ``pos``, and the cache. Only the last
        position meets the output head: a prompt's other positions need no logits.
        ``head_columns``: the head's table as ``[d_model, vocab]``, where the caller holds it
        so (None: ``head_table``)."""
        batch, chunk = tokens.shape
        x, new_cache = self.features(tokens, None, cache, pos, start=start)
        assert new_cache is not None  # features given a cache returns it updated
        last = x.reshape(batch, chunk, -1)[:, -1]
        if head_columns is None:
            return self.head_logits(last), new_cache
        return softcapped(jax.lax.dot_general(last, head_columns, (((1,), (0,)), ((), ())),
                                              preferred_element_type=jnp.float32),
                          self.final_softcap), new_cache

    def features(self, tokens: jax.Array, key: jax.Array | None = None,
                 cache: list[KV] | None = None, pos: jax.Array | int = 0,
                 segments: Segments | None = None,
                 segment_positions: jax.Array | None = None,
                 router: list[RouterStats] | None = None,
                 start: jax.Array | None = None,
                 ) -> tuple[jax.Array, list[KV] | None]:
        """The final norm's output ``[batch * chunk, d_model]``, in the params' dtype: what the
        output head multiplies by its table (``head_table``).

        segments, segment_positions: ``[batch, chunk]`` for rows of packed documents: each
        token's document (attention stays inside it) and its position there (``< chunk``);
        or for rows of sequences sharing prefixes, ``SharedPrefixes`` and each token's position
        in its sequence.
        router: a list the summed router statistics of the expert layers are appended to.
        start: with a cache, each row's first slot (``[batch]``): its positions count from
        there, and the slots before it are not attended to (a batch of prompts, left-padded)."""
        batch, chunk = tokens.shape
        positions = pos + jnp.arange(chunk)
        # left padding delays each row's positions (packed documents restart them instead)
        own = None if start is None else jnp.maximum(positions[None] - start[:, None], 0)
        # The table's own dtype: nnx.Embed would promote a bfloat16 table's rows to the float32
        # it was created in, and the whole residual stream with them.
        table = self.embed.embedding[...]
        ids = tokens.astype(jnp.int32)
        x = jnp.take(table, ids, axis=0)
        if self.pad_id is not None:  # transformers' padding_idx: the values read, no gradient
            x = jnp.where((ids == self.pad_id)[..., None], jax.lax.stop_gradient(x), x)
        if self.embed_scale is not None:  # in the table's dtype, as Gemma scales it
            x = x * jnp.asarray(self.embed_scale, x.dtype)
        if self.positions is not None:
            at = (segment_positions if segment_positions is not None else
                  positions[None] if own is None else own)
            x = x + jnp.take(self.positions[...], at, axis=0).astype(x.dtype)
            ropes: list[Rope | None] = [None] * self.layers
        else:
            global_rope = self._rope(self.rotary, chunk, pos, segment_positions, own)
            local_rope = (None if self.local_rotary is None else
                          self._rope(self.local_rotary, chunk, pos, segment_positions, own))
            ropes = [local_rope if own else global_rope for own in self.own_rotary]
        x = _dropout(self.drop, x, key, 0)
        if cache is not None:
            new_cache: list[KV] = []
            for i in range(self.layers):
                x, kv, _ = self.blocks[f"{i}"](x, ropes[i], None, cache[i], pos, start=start)
                assert kv is not None  # a block given its cache returns it updated
                new_cache.append(kv)
            return self.ln_f(x).reshape(batch * chunk, -1), new_cache
        x, stats = self._blocks(x, ropes, key, segments)
        if router is not None and stats is not None:
            router.append(stats)
        return self.ln_f(x).reshape(batch * chunk, -1), None

    @staticmethod
    def _rope(rotary: tuple[Any, ...], chunk: int, pos: jax.Array | int,
              segment_positions: jax.Array | None,
              row_positions: jax.Array | None = None) -> Rope:
        """The rotary angles of the chunk's positions for one rotary scheme (``row_positions``:
        ``[batch, chunk]``, each row's own, computed in the program)."""
        if row_positions is not None:
            return Rope.at(row_positions, rotary_frequencies(*rotary))
        if segment_positions is not None:
            # Packed rows: positions restart in each document. The rotary table stays a
            # constant (see below), gathered per token.
            table = _static_rope(0, chunk, rotary)
            return Rope(*(jnp.take(t, segment_positions, axis=0) for t in table))
        if isinstance(pos, int | np.integer):
            # Static positions (training, a prefill at 0): the table becomes a constant. Left in
            # the program, XLA:CPU fuses sin and cos into their consumers and evaluates them
            # again for every element they scale (BENCHMARKS.md, "The byte LM against PyTorch
            # on CPU": the rotary table computed in the step).
            return _static_rope(int(pos), chunk, rotary)
        return Rope.at(pos + jnp.arange(chunk), rotary_frequencies(*rotary))

    def _blocks(self, x: jax.Array, ropes: list[Rope | None], key: jax.Array | None,
                segments: Segments | None = None) -> tuple[jax.Array, RouterStats | None]:
        """The layers in training and eval: unrolled, or one block under ``lax.scan`` over the
        layers' params stacked on the fly; each optionally rematerialized. The params keep one
        entry per layer either way, so checkpoints do not depend on these settings. Layer
        ``i``'s dropout key is ``fold_in(key, i + 1)`` in every form."""
        total: RouterStats | None = None
        if not self.scan_layers and self.remat == "none":
            for i in range(self.layers):
                layer_key = None if key is None else jax.random.fold_in(key, i + 1)
                x, _, stats = self.blocks[f"{i}"](x, ropes[i], layer_key, segments=segments)
                total = _summed(total, stats)
            return x, total
        split = [nnx.split(self.blocks[f"{i}"]) for i in range(self.layers)]
        if not self.scan_layers:
            for i, (graphdef, state) in enumerate(split):
                x, stats = self._layer(graphdef, ropes[i], key, segments)(state, x,
                                                                          jnp.uint32(i + 1))
                total = _summed(total, stats)
            return x, total
        return self._scanned(x, split, ropes[0], key, segments)

    def _scanned(self, x: jax.Array, split: list[tuple[nnx.GraphDef, nnx.State]],
                 rope: Rope | None, key: jax.Array | None, segments: Segments | None
                 ) -> tuple[jax.Array, RouterStats | None]:
        """The layers (``split``: each one's graph and params) as one block under ``lax.scan``
        over their params stacked here; ``rope``: every layer's (under scan every layer is
        alike, as TransformerModel checks). Router statistics come back summed over layers."""
        states = [state for _, state in split]
        block = self._layer(split[0][0], rope, key, segments)
        stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *states)
        x, per_layer = jax.lax.scan(lambda x, layer: block(layer[0], x, layer[1]), x,
                                    (stacked, jnp.arange(1, self.layers + 1, dtype=jnp.uint32)))
        return x, (None if per_layer is None else
                   RouterStats(*(jnp.sum(t, axis=0) for t in per_layer)))

    def _layer(self, graphdef: nnx.GraphDef, rope: Rope | None, key: jax.Array | None,
               segments: Segments | None
               ) -> Callable[..., tuple[jax.Array, RouterStats | None]]:
        """A layer as a function of its params, ``x`` and its index (``uint32``, from 1: its
        dropout key is ``fold_in(key, index)``), rematerialized as ``remat`` says."""
        def block(state: nnx.State, x: jax.Array, index: jax.Array
                  ) -> tuple[jax.Array, RouterStats | None]:
            layer_key = None if key is None else jax.random.fold_in(key, index)
            x, _, stats = nnx.merge(graphdef, state)(x, rope, layer_key, segments=segments)
            return x, stats

        if self.remat == "none":
            return block
        # Under scan the loop already keeps the recomputation in the backward pass, so the
        # barrier against CSE is not needed (JAX's advice for checkpoint inside scan).
        # Unrolled, XLA:CPU is free to schedule the recomputation early: there remat did
        # not lower the step's temporaries (BENCHMARKS.md, "Layers under scan").
        return jax.checkpoint(block, policy=REMAT_POLICIES[self.remat],
                              prevent_cse=not self.scan_layers)

    def empty_cache(self, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> list[KV]:
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        return [KV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.layers)]


def _summed(total: RouterStats | None, stats: RouterStats | None) -> RouterStats | None:
    """``total`` plus one more layer's router statistics (None: a layer without experts)."""
    if stats is None:
        return total
    return stats if total is None else total + stats


def _lm_loss(module: Transformer, batch: dict[str, jax.Array], key: jax.Array | None,
             chunk: int = 0, router_aux: float = 0.0, head: HeadPath = PLAIN_HEAD):
    """``batch["tokens"]``: ``[batch, seq_len + 1]``; predict each next token. The head and loss
    run in chunks of ``chunk`` tokens (``losses.next_token_from_features``), as ``head`` says.

    Rows of packed documents also hold ``segment_ids`` and ``positions`` (``[batch, seq_len +
    1]``, ``data/documents.py``): attention stays in each document, and the loss is the mean
    over the targets in the same document as their input (aux ``weight``: their number), so
    padding and document boundaries count for nothing. With ``loss_mask`` (``[batch, seq_len +
    1]``) only the targets it marks count: an answer's tokens, not its prompt's. With
    ``token_bytes`` (the bytes each token stands for) aux ``bits_per_byte`` is the targets' nats
    / ln 2 / their bytes, and ``weight/bits_per_byte`` those bytes, so eval combines batches by
    bytes."""
    tokens = batch["tokens"]
    router: list[RouterStats] = []
    if "segment_ids" not in batch:
        features, _ = module.features(tokens[:, :-1], key, router=router)
        unit = "bits_per_byte" if tokens.dtype == jnp.uint8 else "bits_per_token"
        return _with_router(next_token_from_features(
            features, module.head_table(), tokens[:, 1:].reshape(-1), chunk, unit,
            softcap=module.final_softcap, path=head), router, router_aux)
    segments = batch["segment_ids"].astype(jnp.int32)
    inputs = segments[:, :-1]
    features, _ = module.features(tokens[:, :-1], key, segments=inputs,
                                  segment_positions=batch["positions"][:, :-1].astype(jnp.int32),
                                  router=router)
    counted = (segments[:, 1:] == inputs) & (inputs > 0)
    if "loss_mask" in batch:  # instruction data: only the answers' tokens are targets
        counted = counted & (batch["loss_mask"][:, 1:] > 0)
    loss, aux = next_token_from_features(features, module.head_table(),
                                         tokens[:, 1:].reshape(-1), chunk, "bits_per_token",
                                         weights=counted.reshape(-1),
                                         softcap=module.final_softcap, path=head)
    if "token_bytes" in batch:
        covered = jnp.sum(jnp.where(counted, batch["token_bytes"][:, 1:], 0), dtype=jnp.float32)
        aux["bits_per_byte"] = loss * aux["weight"] / LN2 / jnp.maximum(covered, 1.0)
        aux["weight/bits_per_byte"] = covered
    return _with_router((loss, aux), router, router_aux)


def _with_router(result: tuple[jax.Array, dict[str, jax.Array]], router: list[RouterStats],
                 coefficient: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss with the experts' load-balancing term added (times ``coefficient``), and as
    metrics that term and each expert's share of the routed tokens; unchanged without
    experts."""
    if not router:
        return result
    loss, aux = result
    stats = router[0]
    balance = load_balancing_loss(stats)
    share = stats.chosen.sum(0) / jnp.maximum(stats.chosen.sum(), 1.0)
    aux = {**aux, "router_aux_loss": balance,
           **{f"expert_share/{e}": share[e] for e in range(share.shape[0])}}
    return loss + jnp.float32(coefficient) * balance, aux


def make_transformer(cfg: TransformerModel, attention: AttentionPath = AttentionPath(),
                     head: HeadPath = PLAIN_HEAD) -> Model:
    """The language model ``cfg`` describes; ``attention`` and ``head``: how its attention and
    its head's loss are computed (the plain paths by default)."""

    def loss(module: Transformer, batch: dict[str, jax.Array], key: jax.Array | None):
        return _lm_loss(module, batch, key, cfg.loss_chunk, cfg.router_aux_loss, head)

    return from_nnx(lambda rngs: Transformer(cfg, rngs, attention), loss, name="transformer",
                    eval_loss=lambda module, batch: loss(module, batch, None),
                    same_module=_module_key(cfg, attention))


def _module_key(cfg: TransformerModel, attention: AttentionPath
                ) -> tuple[str, str, AttentionPath]:
    """What names the ``Transformer`` a config builds, for tracing its shapes once: its
    config, less the ``seq_len`` of rotary positions, which shapes nothing in the module (a
    run's model and the longer context it decodes within are one module)."""
    shaping = cfg if cfg.positions == "learned" else cfg.model_copy(update={"seq_len": 0})
    return ("transformer", shaping.model_dump_json(), attention)


def parameter_count(cfg: TransformerModel) -> int:
    """How many params ``Transformer(cfg)`` has, counted from the config alone: a model too
    large for memory is refused on this before a layer of it is built."""
    d, hidden, head_dim = cfg.d_model, cfg.hidden, cfg.attention_head_dim
    inner, kv_inner = cfg.heads * head_dim, cfg.kv_key_heads * head_dim
    norm = 2 * d if cfg.norm == "layernorm" else d
    qk_norms = inner + kv_inner if cfg.qk_norm_over == "projection" else 2 * head_dim
    qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attention_bias
    o_bias, mlp_bias = cfg.bias or cfg.attention_bias, cfg.bias or cfg.mlp_bias
    attention = (d * inner + 2 * d * kv_inner + inner * d
                 + (inner + 2 * kv_inner if qkv_bias else 0) + (d if o_bias else 0)
                 + (qk_norms if cfg.qk_norm else 0))
    mlp = (3 if cfg.gated else 2) * d * hidden
    if mlp_bias:
        mlp += (2 if cfg.gated else 1) * hidden + d
    shapes = {"q": (d, inner), "k": (d, kv_inner), "v": (d, kv_inner), "o": (inner, d),
              "gate": (d, hidden), "up": (d, hidden), "down": (hidden, d)}
    if cfg.fused_projections:  # one adapter over q, k, v and one over gate, up
        shapes.update(q=(d, inner + 2 * kv_inner), k=(0, 0), v=(0, 0), gate=(d, 2 * hidden),
                      up=(0, 0))
    rank = cfg.lora.rank if cfg.lora is not None else 0
    in_attention = {"q", "k", "v", "o"} & cfg.adapted
    adapters = sum(rank * sum(shapes[t]) for t in in_attention)
    if cfg.experts is None:  # a mixture's dense layers carry no adapters
        mlp += sum(rank * sum(shapes[t]) for t in cfg.adapted - in_attention)
    block = (2 * cfg.pre_norms + 2 * cfg.post_norms) * norm + attention + adapters
    experts = 0
    if cfg.experts is not None:
        shared = cfg.shared_expert_hidden or 0
        width = cfg.expert_width
        experts = (d * cfg.experts + 3 * cfg.experts * d * width
                   + (3 * d * shared + d if shared else 0))
        expert_shapes = {"gate": (d, width), "up": (d, width), "down": (width, d)}
        experts += sum(rank * cfg.experts * sum(expert_shapes[t])
                       for t in cfg.adapted & set(expert_shapes))
        experts += rank * (d + cfg.experts) if "router" in cfg.adapted else 0
    expert_layers = cfg.expert_layer_count()
    layers = cfg.layers * block + expert_layers * experts + (cfg.layers - expert_layers) * mlp
    table = cfg.vocab * d
    return (table + (cfg.seq_len * d if cfg.positions == "learned" else 0)
            + layers + norm + (0 if cfg.tie_embeddings else table))


def embedding_rows(cfg: TransformerModel) -> str:
    """What the embedding's rows learn from their lookups, in a line a run says as it starts."""
    if cfg.pad_id is None:
        return ("embedding: every row learns from its lookups (no pad token's row is held out; "
                "model.pad_id names one, as transformers' padding_idx)")
    tied = "; the tied head's gradient still reaches it" if cfg.tie_embeddings else ""
    return (f"embedding: row {cfg.pad_id}, the pad token's (model.pad_id), learns nothing from "
            f"its lookups, as with transformers' padding_idx{tied}")


def bind_transformer(cfg: TransformerModel, attention: AttentionPath = AttentionPath()
                     ) -> Callable[..., Transformer]:
    """``params -> Transformer`` holding them (for sampling from trained params)."""
    return bind_params(lambda rngs: Transformer(cfg, rngs, attention),
                       name="transformer", same_module=_module_key(cfg, attention))


def merge_adapters(cfg: TransformerModel, params: PyTree) -> tuple[TransformerModel, PyTree]:
    """The model without adapters that computes what ``params`` with adapters compute: each
    targeted kernel (an expert's weights, the router) becomes ``W + (alpha / rank) A B``
    (float32), a fused adapter's ``A B`` split over the layers it spans; the adapters are
    dropped."""
    if cfg.lora is None:
        return cfg, params
    scale = np.float32(cfg.lora.alpha / cfg.lora.rank)
    fused = {"qkv_lora": ("q", "k", "v"), "gate_up_lora": ("gate", "up")}
    blocks = {}
    for i, block in params["blocks"].items():
        merged = {}
        for part, layers in block.items():
            if part not in ("attn", "mlp"):
                merged[part] = layers
                continue
            deltas: dict[str, np.ndarray] = {}
            for name, adapter in layers.items():
                if not name.endswith("_lora"):
                    continue
                # batched over the experts where the adapter is an expert's
                delta = scale * np.matmul(np.asarray(adapter["a"], np.float32),
                                          np.asarray(adapter["b"], np.float32))
                spans = fused.get(name, (name.removesuffix("_lora"),))
                widths = [_kernel(layers[n]).shape[-1] for n in spans]
                cuts = np.cumsum(widths)[:-1]
                deltas.update(zip(spans, np.split(delta, cuts, axis=-1), strict=True))
            merged[part] = {}
            for name, layer in layers.items():
                if name.endswith("_lora"):
                    continue
                if name in deltas:
                    kernel = np.asarray(_kernel(layer), np.float32) + deltas[name]
                    layer = {**layer, "kernel": kernel} if isinstance(layer, dict) else kernel
                merged[part][name] = layer
        blocks[i] = merged
    return cfg.model_copy(update={"lora": None}), {**params, "blocks": blocks}


def _kernel(layer: PyTree) -> Any:
    """A linear layer's kernel; an expert layer's (or the router's) param is the array."""
    return layer["kernel"] if isinstance(layer, dict) else layer
