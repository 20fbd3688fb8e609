"""trainrun's training step against a plain-JAX step written here, on one TPU chip (or, with
``--tiny``, on any backend at toy sizes: a check of the code, not a measurement).

    python benchmarks/tpu_step.py --out DIR [--tiny] [--parts gpt2,qwen,micro,init] [--profile]
        [--profile-top 15] [--micro-kinds head,attention] [--budget-s 370] [--rounds 5]
        [--compile-threads 7] [--compile-alone 2] [--compile-profile TOP]
        [--gpt2-rows 8,16]
        [--gpt2-extra select,none,plain-paths,concat-norms,xla,whole-logits,scan]
        [--gpt2-attention A] [--gpt2-head H] [--gpt2-chunk N]
        [--qwen-rows 8,4,2,1] [--qwen-target 4] [--qwen-extra none,select]
        [--qwen-plain 1x4,1x1] [--qwen-attention A] [--qwen-head H] [--qwen-chunk N]
        [--qwen-layers scan|unrolled] [--qwen-remat full|none|...]

Both sides train the same model from the same params on the same random tokens: trainrun's
``make_train_step`` with its transformer and AdamW, and a plain step written below (optax
AdamW, ``jax.nn.dot_product_attention``, full logits and optax's cross-entropy); bfloat16
compute on float32 masters, K steps per jitted call under ``lax.scan``, the state donated.
"trainrun" is the step as a user gets it on a TPU: the attention and head paths trainrun's
strategies choose there (``fast/strategies.py``, ``TRAINRUN_FAST_PATHS`` honoured), its
non-finite guard, the config's default ``loss_chunk``; ``--gpt2-attention`` and the like
change one choice (A: ``library``, ``xla``, ``splash``, ``splash:BQxBKV[:unfused][:c=N]
[:minor=qkv]``: N the key rows of the kernel's inner step, ``minor`` the inputs it reads with
the sequence minor-most; H: ``library``, ``unrolled``, ``scan``).

Parts:

  gpt2   GPT-2 small (vocabulary 50304, 12 x 768, 12 heads, rope, tied head), 1024 tokens a row,
         K=10, at each of ``--gpt2-rows``: the plain step and trainrun, and at the first rows
         trainrun with its guard as a select of every leaf (``select``), without a guard (``none``),
         on its plain paths (``plain-paths``: XLA's attention, the head's chunks scanned, the
         select, the norms concatenated), its norms over the leaves laid end to end
         (``concat-norms``), with XLA's attention alone (``xla``), its logits whole
         (``whole-logits``) or its layers under scan (``scan``); ``chunk=N`` its head's chunks
         of N tokens, ``remat=P`` each layer rematerialized by ``model.remat`` P,
         ``attention=A`` its attention as ``--gpt2-attention`` says, ``a+b`` the changes of
         both. One state on the device, handed from call to call; each contender's first call
         starts from the same fresh state (their losses compared), then
         interleaved rounds (one call of each, a blocking read; medians). The plain step's and
         trainrun's programs at the first rows (and the extras after them, up to ``--compile-alone``
         programs) are compiled first, one at a time, cold (no compilation cache): their compile
         seconds compare alone, and each is put through the cache's write and read by hand
         (serialized, compressed, decompressed, loaded: the seconds of each and its size).
  qwen   a Qwen2.5-0.5B shape (vocabulary 151936, 24 layers, d_model 896, 14 query and 2
         key/value heads, SwiGLU 4864, RMSNorm, q/k/v biases, tied head), 2048 tokens a row,
         K=4: trainrun (layers under scan, rematerialized, as ``--qwen-layers``/``--qwen-remat``
         say) at each of ``--qwen-rows`` that fits, down to the first that fits at or below
         ``--qwen-target`` rows; trainrun without its guard (``--qwen-extra none``) or with
         it as a select at the target; the plain step at the first of ``--qwen-plain``
         (ROWSxK) that fits. Sizes above the target are compiled with every other program,
         the smaller ones only where the larger did not fit (no timing runs meanwhile). Its
         state and each side's temporaries fill most of the chip, so the contenders run one
         after another, not interleaved: each from its own fresh state (the same init bits),
         everything of the one before freed first.
  init   the state at step 0 at both shapes, three ways: trainrun's init program (compiled
         without XLA's algebraic simplifier, as ``init_state`` does), the same program with it,
         and the builder called op by op: trace, compile and run seconds, and whether each gives
         trainrun's bits.
  micro  the head's loss (chunks scanned or unrolled, chunk sizes) and causal attention (XLA's,
         Pallas splash attention at several blocks and layouts, Pallas flash attention; those of
         ``--micro-kinds``) alone, forward and
         backward, at both shapes: time, compiled memory, values and gradients against the
         plain path's. Its fastest choices (a chunk only where its float32 logits stay within
         ``CHUNK_LOGITS_BUDGET``) replace the defaults not given on the command line.

Every program of a run (the 0.5B shape's fallbacks aside, compiled between timings) is compiled
before any is timed, on a pool of host threads (``--compile-threads``; each such figure is a
compile beside others), so no timing runs beside a compile. Whether a side fits is the chip's
own verdict: the compile (XLA refuses a program whose temporaries exceed the chip) and the
first call (the runtime refuses what it cannot allocate); XLA's memory analysis (temp +
argument + output - alias + generated code) is reported beside it.

Reported: ms/step, tokens/s, MFU against 197 TFLOP/s (v5e's datasheet) and against a bfloat16
8192^3 matmul measured in this process, by one analytic FLOP count for both sides (6 x params x
tokens + 12 x layers x seq x width x tokens) and by XLA's count of each program (trainrun's own
count; a Pallas kernel's FLOPs are not in it); compile seconds; compiled memory. ``--profile``:
one call of each contender at GPT-2's first rows under ``jax.profiler``, the device's ops
summed per step (the ``--profile-top`` costliest). ``--compile-profile``: each program compiled
alone under ``jax.profiler``, the compiler's host events summed by name, self time (what XLA
spends its compile on, pass by pass where it names them). A markdown report on stdout and in
OUT/tpu_step.md; every figure in OUT/tpu_step.json (both written again as each part ends, so
a run stopped early keeps what it measured).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import glob
import gzip
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.fast.strategies import chosen
from trainrun.fast.tpu_attention import SEQ_MINOR, SplashAttention
from trainrun.models.losses import PLAIN_HEAD, HeadPath, next_token_from_features
from trainrun.models.transformer import (
    PLAIN_ATTENTION,
    AttentionPath,
    causal_attention,
    make_transformer,
)
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import Policy
from trainrun.program.state import (
    INIT_COMPILER_OPTIONS,
    _state_builder,
    abstract_state,
    init_program,
    init_state,
)
from trainrun.program.step import (
    KeepIfNot,
    Norm,
    global_norm,
    keep_if_not,
    make_multi_step,
    make_train_step,
)

PEAK_BF16 = 197e12  # TPU v5e datasheet, dense bfloat16
OPTIM = OptimizerConfig(name="adamw", lr=6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
COMPUTE = jnp.bfloat16
MiB, GiB = 2**20, 2**30
# a chunk's float32 logits at most this: its backward pass holds about three times as much
CHUNK_LOGITS_BUDGET = 1.25 * GiB
DEFAULT_CHUNK = TransformerModel.model_fields["loss_chunk"].default

SAID: list[str] = []  # every line printed, for OUT/tpu_step.md


def say(text: str = "") -> None:
    SAID.append(text)
    print(text, flush=True)


# ---- shapes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    seq: int
    batch: int  # rows of the micro part
    k: int  # steps per call
    mlp: str = "gelu"
    norm: str = "layernorm"
    eps: float = 1e-5
    rope_theta: float = 10_000.0
    qkv_bias: bool = False
    loss_chunk: int = DEFAULT_CHUNK

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def config(self, **changes: Any) -> TransformerModel:
        fields = dict(
            vocab=self.vocab, d_model=self.d_model, layers=self.layers, heads=self.heads,
            kv_heads=self.kv_heads, mlp=self.mlp, mlp_hidden=self.hidden, norm=self.norm,
            norm_eps=self.eps, seq_len=self.seq, positions="rope", rope_theta=self.rope_theta,
            qkv_bias=self.qkv_bias, tie_embeddings=True, dropout=0.0, init_std=0.02,
            loss_chunk=self.loss_chunk)
        return TransformerModel(**{**fields, **changes})

    def flops_per_token(self, params: int) -> float:
        """6 x params + 12 x layers x seq x attention width (the causal mask not discounted)."""
        return 6 * params + 12 * self.layers * self.seq * self.heads * self.head_dim


def shapes(tiny: bool) -> dict[str, Shape]:
    if tiny:
        return {
            "gpt2": Shape("gpt2-tiny", 512, 128, 1, 2, 2, 512, 128, 2, 2, loss_chunk=128),
            "qwen": Shape("qwen-tiny", 1000, 128, 1, 4, 2, 256, 128, 2, 2, mlp="swiglu",
                          norm="rmsnorm", eps=1e-6, rope_theta=1e6, qkv_bias=True,
                          loss_chunk=128),
        }
    return {
        "gpt2": Shape("GPT-2 small", 50304, 768, 12, 12, 12, 3072, 1024, 8, 10),
        "qwen": Shape("Qwen2.5-0.5B shape", 151936, 896, 24, 14, 2, 4864, 2048, 4, 4,
                      mlp="swiglu", norm="rmsnorm", eps=1e-6, rope_theta=1e6, qkv_bias=True),
    }


# ---- the plain step, written here -----------------------------------------------------------


def _norm(x: jax.Array, p: dict[str, jax.Array], kind: str, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    if kind == "rmsnorm":
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + eps)
        return (y * p["scale"].astype(jnp.float32)).astype(x.dtype)
    mean = jnp.mean(x32, -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), -1, keepdims=True) + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _linear(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def plain_loss(p: Any, tokens: jax.Array, s: Shape, remat: bool = False) -> jax.Array:
    """The model's mean next-token cross-entropy, written plainly over trainrun's params;
    ``remat``: each layer's activations recomputed in the backward pass (``jax.checkpoint``)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, seq = inputs.shape
    table = p["embed"]["embedding"]
    x = jnp.take(table, inputs, axis=0)
    half = s.head_dim // 2
    freqs = 1.0 / s.rope_theta ** (np.arange(0, s.head_dim, 2, dtype=np.float32) / s.head_dim)
    angles = np.arange(seq, dtype=np.float32)[:, None] * freqs.astype(np.float32)
    sin, cos = (jnp.asarray(f(angles), x.dtype)[:, None, :] for f in (np.sin, np.cos))

    def rope(t: jax.Array) -> jax.Array:
        a, b = t[..., :half], t[..., half:]
        return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def layer(x: jax.Array, block: Any) -> jax.Array:
        att = block["attn"]
        h = _norm(x, block["ln1"], s.norm, s.eps)
        q = _linear(h, att["q"]).reshape(batch, seq, s.heads, s.head_dim)
        k = _linear(h, att["k"]).reshape(batch, seq, s.kv_heads, s.head_dim)
        v = _linear(h, att["v"]).reshape(batch, seq, s.kv_heads, s.head_dim)
        o = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + _linear(o.reshape(batch, seq, -1), att["o"])
        h = _norm(x, block["ln2"], s.norm, s.eps)
        mlp = block["mlp"]
        if s.mlp == "swiglu":
            h = jax.nn.silu(_linear(h, mlp["gate"])) * _linear(h, mlp["up"])
        else:
            h = jax.nn.gelu(_linear(h, mlp["up"]), approximate=True)
        return x + _linear(h, mlp["down"])

    each = jax.checkpoint(layer) if remat else layer
    for i in range(s.layers):
        x = each(x, p["blocks"][str(i)])
    x = _norm(x, p["ln_f"], s.norm, s.eps)
    logits = x @ table.T
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           targets).mean()


def plain_optimizer() -> optax.GradientTransformation:
    return optax.adamw(OPTIM.lr, b1=OPTIM.b1, b2=OPTIM.b2, eps=OPTIM.eps,
                       weight_decay=OPTIM.weight_decay,
                       mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))


def plain_multi_step(s: Shape, remat: bool = False) -> Callable[..., Any]:
    tx = plain_optimizer()

    def step(carry: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(lambda p: plain_loss(
            jax.tree.map(lambda x: x.astype(COMPUTE), p), tokens, s, remat))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return lambda carry, batches: jax.lax.scan(step, carry, batches)


# ---- contenders ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """A contender: the plain step, or trainrun's with an attention path, a head path and
    model options (``loss_chunk``, ``scan_layers``, ``remat``). ``guard``: trainrun's
    non-finite guard as its strategy chooses it (``library``), a select of every leaf
    (``select``, the plain path's) or none (``none``: what the guard costs, not an option of
    trainrun's). ``norm``: the step's norms as trainrun's strategy chooses them (``library``)
    or over the leaves laid end to end (``concatenated``, the plain path's)."""

    name: str
    plain: bool = False
    attention: AttentionPath = PLAIN_ATTENTION
    head: HeadPath = PLAIN_HEAD
    options: tuple[tuple[str, Any], ...] = ()
    guard: str = "library"
    norm: str = "library"

    def describe(self) -> str:
        if self.plain:
            remat = ", each layer rematerialized" if dict(self.options).get("remat") else ""
            return f"plain JAX (optax AdamW, XLA attention, full bf16 logits, optax CE{remat})"
        parts = [_attention_name(self.attention), _head_name(self.head)]
        parts += [f"{k}={v}" for k, v in dict(self.options).items()]
        guard = {"library": "guard: trainrun's", "select": "guard: a select",
                 "none": "no non-finite guard"}[self.guard]
        norms = [] if self.norm == "library" else ["norms concatenated"]
        return ", ".join([*parts, guard, *norms])

    def keep(self, k: int) -> KeepIfNot:
        if self.guard == "none":
            return lambda finite, new, old: new
        if self.guard == "select":
            return keep_if_not
        return chosen().nonfinite_guard(k)

    def norms(self) -> Norm:
        return global_norm if self.norm == "concatenated" else chosen().norm()


def _attention_name(path: AttentionPath) -> str:
    kernel = path.kernel
    if isinstance(kernel, SplashAttention):
        blocks = (f"{kernel.block_q}x{kernel.block_kv}" if kernel.block_q
                  else "blocks by length")
        more = (f" compute {kernel.block_kv_compute}" if kernel.block_kv_compute else "") + (
            f" {kernel.seq_minor or 'none'} seq-minor")
        return f"splash {blocks}{more}{' fused bwd' if kernel.fused_backward else ''}"
    return "XLA attention"


def _head_name(path: HeadPath) -> str:
    return "head unrolled" if path.unrolled else "head scanned"


def attention_choice(spec: str | None) -> AttentionPath:
    """``library`` (None): what trainrun's strategies choose on a TPU; ``xla``; ``splash``
    (its default blocks); ``splash:BQxBKV[:unfused][:c=N][:minor=qkv]`` (``c``: the key rows
    of the kernel's inner step; ``minor``: the inputs read with the sequence minor-most)."""
    if spec in (None, "library"):
        return chosen().attention(backend="tpu")
    if spec == "xla":
        return PLAIN_ATTENTION
    parts = spec.split(":")
    usage = "give library, xla, splash or splash:BQxBKV[:unfused][:c=N][:minor=qkv]"
    if parts[0] != "splash":
        raise SystemExit(f"attention {spec!r}: {usage}")
    if len(parts) == 1:
        return AttentionPath(kernel=SplashAttention())
    bq, bkv = (int(x) for x in parts[1].split("x"))
    options = dict(o.partition("=")[::2] for o in parts[2:])
    if set(options) - {"unfused", "c", "minor"}:
        raise SystemExit(f"attention {spec!r}: {usage}")
    return AttentionPath(kernel=SplashAttention(
        bq, bkv, fused_backward="unfused" not in options,
        block_kv_compute=int(options["c"]) if options.get("c") else None,
        seq_minor=options.get("minor", SEQ_MINOR)))


def head_choice(spec: str | None) -> HeadPath:
    """``library`` (None): what trainrun's strategies choose on a TPU; ``unrolled``; ``scan``."""
    if spec in (None, "library"):
        return chosen().head_loss(backend="tpu")
    if spec not in ("unrolled", "scan"):
        raise SystemExit(f"head {spec!r}: give library, unrolled or scan")
    return HeadPath(unrolled=spec == "unrolled")


# ---- a shape's state, and a side: one contender compiled at one batch ------------------------


class Model:
    """A shape's model and optimizer, its abstract state (known without allocating it) and
    its state at step 0, made once and kept in host memory: every contender starts from the
    same bits. The plain step takes the state's params and AdamW state, whose layout it
    shares."""

    def __init__(self, s: Shape):
        self.s = s
        self.model, self.optimizer = make_transformer(s.config()), build_optimizer(OPTIM)
        self.policy = Policy(compute=COMPUTE)
        self.abstract = abstract_state(self.model, self.optimizer, 0, self.policy)
        self.params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract.params))
        plain_state = jax.eval_shape(plain_optimizer().init, self.abstract.params)
        if jax.tree.structure(plain_state) != jax.tree.structure(self.abstract.opt_state):
            raise RuntimeError("the plain AdamW state is not laid out as trainrun's")
        self.initial: Any = None
        self.state: Any = None

    def ready(self) -> None:
        if self.initial is None:
            state = init_state(self.model, self.optimizer, seed=0, policy=self.policy)
            self.initial = jax.device_get(state)
            delete(state)

    def fresh(self) -> None:
        """The state at step 0 on the device (any state there before deleted first)."""
        self.drop()
        self.ready()
        self.state = jax.device_put(self.initial)

    def drop(self) -> None:
        delete(self.state)
        self.state = None


def delete(tree: Any) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def is_out_of_memory(err: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower()


def first_line(err: BaseException, width: int = 300) -> str:
    text = str(err).strip().splitlines() or [""]
    return f"{type(err).__name__}: {text[0][:width]}"


class Side:
    """A contender lowered at ``rows`` x K (here, in the calling thread) and compiled by
    ``compile`` (here or on the pool); ``run`` takes the model's state through one call of K
    steps and returns the losses."""

    def __init__(self, variant: Variant, m: Model, rows: int, k: int):
        s = m.s
        self.variant, self.s, self.rows, self.k = variant, s, rows, k
        self.name = f"{s.name}: {variant.name} @{rows}x{k}"
        self.shape = jax.ShapeDtypeStruct((k, rows, s.seq + 1), jnp.int32)
        self.compiled: Any = None
        self.mem: dict[str, float] = {}  # XLA's memory analysis, kept past ``free``
        self.compile_s = math.nan
        self.alone = False  # compiled with no other compile beside it
        self.compile_error: str | None = None
        self.run_verdict = "not tried"  # "ok", or why its first call failed
        self.tokens: Any = None
        start = time.perf_counter()
        if variant.plain:
            fn = jax.jit(plain_multi_step(s, dict(variant.options).get("remat", False)),
                         donate_argnums=0)
            self.lowered = fn.lower((m.abstract.params, m.abstract.opt_state), self.shape)
        else:
            model = make_transformer(s.config(**dict(variant.options)), variant.attention,
                                     variant.head)
            step = make_train_step(model, m.optimizer, policy=m.policy, keep=variant.keep(k),
                                   norm=variant.norms())
            fn = jax.jit(make_multi_step(step), donate_argnums=0)
            self.lowered = fn.lower(m.abstract, {"tokens": self.shape})
        self.lower_s = time.perf_counter() - start

    def compile(self) -> Side:
        start = time.perf_counter()
        try:
            self.compiled = self.lowered.compile()
            self.mem = memory_of(self.compiled)
        except Exception as err:  # RESOURCE_EXHAUSTED: the compiler's verdict, reported
            self.compile_error = first_line(err)
        self.compile_s = time.perf_counter() - start
        self.lowered = None  # its text is large and no longer needed
        return self

    def run(self, m: Model) -> np.ndarray:
        if self.tokens is None:  # the same tokens for every contender of a shape and size
            self.tokens = jax.random.randint(jax.random.key(2), self.shape.shape, 0,
                                             self.s.vocab, jnp.int32)
        state = m.state
        m.state = None  # donated: gone whether the call succeeds or not
        try:
            if self.variant.plain:
                (params, opt_state), losses = self.compiled((state.params, state.opt_state),
                                                            self.tokens)
                m.state = state.replace(params=params, opt_state=opt_state)
            else:
                m.state, metrics = self.compiled(state, {"tokens": self.tokens})
                losses = metrics["loss"]
            jax.block_until_ready(m.state)
        except Exception:  # what the failed call left of either state is off the chip
            delete((state, m.state))
            m.state = None
            raise
        return np.asarray(losses, np.float32)

    def free(self) -> None:
        """The program and the tokens off the device."""
        self.compiled = None
        delete(self.tokens)
        self.tokens = None


def memory_of(compiled: Any) -> dict[str, float]:
    """XLA's memory analysis of a compiled program (bytes), and what running it needs."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend answers
        return {}
    if m is None:
        return {}
    got = {name: float(getattr(m, f"{name}_size_in_bytes", 0) or 0)
           for name in ("temp", "argument", "output", "alias", "generated_code")}
    got["peak"] = float(getattr(m, "peak_memory_in_bytes", 0) or 0)
    got["need"] = (got["argument"] + got["output"] - got["alias"] + got["temp"]
                   + got["generated_code"])
    return got


def xla_flops(compiled: Any) -> float | None:
    """XLA's FLOP count of a program; a K-step scan's body is counted once, so: per step."""
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def device_limit() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


# ---- the budget and the compile pool --------------------------------------------------------


class Budget:
    """The time left, the notes, and the pool of host threads the programs compile on."""

    def __init__(self, seconds: float, threads: int):
        self.deadline = time.monotonic() + seconds
        self.threads = threads
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"- {text}")

    def lower(self, variant: Variant, m: Model, rows: int, k: int) -> Side | None:
        try:
            return Side(variant, m, rows, k)
        except Exception as err:
            self.note(f"{m.s.name}: {variant.name} @{rows}x{k}: not traced ({first_line(err)})")
            return None

    def compile_all(self, sides: list[Side], reserve: float,
                    meanwhile: Callable[[], None] = lambda: None) -> list[Side]:
        """Every side compiled on the pool, ``meanwhile`` run here as they compile, then all
        waited for (until the budget less ``reserve`` seconds): the timing that follows runs
        beside no compile. Returns those compiled."""
        futures = [(side, self.pool.submit(side.compile)) for side in sides]
        meanwhile()
        done = []
        for side, future in futures:
            try:
                future.result(timeout=max(self.left() - reserve, 1.0))
            except concurrent.futures.TimeoutError:
                self.note(f"{side.name}: not compiled within the time budget; skipped (its "
                          "compile may still run beside the timing that follows)")
                continue
            if side.compile_error:
                self.note(f"{side.name}: compile failed ({side.compile_error})")
                continue
            done.append(side)
        return done


# ---- timing ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Timed:
    side: Side
    first_losses: list[float]
    times: list[float] = dataclasses.field(default_factory=list)
    failed: str | None = None


def first_call(side: Side, m: Model, budget: Budget) -> Timed | None:
    """The side's first call from a fresh state (its K losses kept); None, with a note, if the
    chip cannot run it."""
    try:
        m.fresh()
        losses = side.run(m)
    except Exception as err:  # RESOURCE_EXHAUSTED and the like: the runtime's verdict
        side.run_verdict = first_line(err)
        budget.note(f"{side.name}: failed at its first call ({side.run_verdict})")
        m.drop()
        return None
    side.run_verdict = "ok"
    return Timed(side, [float(x) for x in losses])


def rounds(timed: list[Timed], m: Model, budget: Budget, wanted: int, reserve: float) -> None:
    """Rounds of one call of each, each ended by a blocking read: at least two, then more
    while the budget (less ``reserve``) allows."""
    done = 0
    while done < wanted:
        round_s = sum(statistics.median(t.times) * t.side.k if t.times else 5.0 for t in timed)
        if done >= 2 and budget.left() - reserve < round_s:
            budget.note(f"timing stopped after {done} rounds (time budget)")
            break
        for t in timed:
            if t.failed:
                continue
            start = time.perf_counter()
            try:
                t.side.run(m)
            except Exception as err:
                t.failed = first_line(err, 200)
                m.fresh()
                continue
            t.times.append((time.perf_counter() - start) / t.side.k)
        done += 1


def results(timed: list[Timed], m: Model, peak: float) -> list[dict[str, Any]]:
    rows = []
    for t in timed:
        side, s = t.side, t.side.s
        step_s = statistics.median(t.times) if t.times else math.nan
        tokens = side.rows * s.seq
        flops = s.flops_per_token(m.params) * tokens
        counted = xla_flops(side.compiled)
        rows.append({
            "name": side.variant.name, "what": side.variant.describe(), "rows": side.rows,
            "seq": s.seq, "k": side.k, "compile_s": side.compile_s,
            "compiled_alone": side.alone, "lower_s": side.lower_s, "step_ms": step_s * 1e3,
            "step_ms_all": [x * 1e3 for x in t.times], "rounds": len(t.times),
            "tokens_per_s": tokens / step_s, "mfu_datasheet": flops / step_s / PEAK_BF16,
            "mfu_measured_peak": flops / step_s / peak, "xla_flops_per_step": counted,
            "mfu_xla_count": (counted / step_s / PEAK_BF16) if counted else None,
            "memory": side.mem, "first_losses": t.first_losses, "failed": t.failed,
        })
    return rows


def loss_checks(rows: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Each contender's first-call losses against the plain step's at the same size: the
    same params, tokens and maths, so they differ by rounding alone."""
    checks = {}
    for r in rows:
        base = next((b for b in rows if b["name"] == PLAIN.name and b["rows"] == r["rows"]
                     and b["k"] == r["k"]), None)
        if base is None or base is r:
            continue
        a, b = np.asarray(r["first_losses"]), np.asarray(base["first_losses"])
        first, last = abs(a[0] - b[0]), abs(a[-1] - b[-1])
        checks[f"{r['name']} @{r['rows']}"] = {
            "first_step_diff": float(first), "last_step_diff": float(last),
            "against": base["name"], "ok": bool(first < tolerance)}
    return checks


def table(title: str, rows: list[dict[str, Any]], checks: dict[str, Any], peak: float) -> None:
    if not rows:
        say(f"\n### {title}\n\nnothing ran")
        return
    say(f"\n### {title}\n")
    say("| contender | rows x seq, K | ms/step | tokens/s | MFU (197 TF/s) | MFU (measured "
        f"{peak / 1e12:.3g} TF/s) | MFU by XLA's count | time / plain's | tokens/s / plain's | "
        "compile s | compiled GiB (temp / need) | loss step 0 / K-1 | check against plain |")
    say("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    plain_rows = [r for r in rows if r["name"] == PLAIN.name]
    for r in rows:
        same = next((p for p in plain_rows if p["rows"] == r["rows"]), None)
        best = max(plain_rows, key=lambda p: p["tokens_per_s"], default=None)
        time_ratio = f"{r['step_ms'] / same['step_ms']:.3f}" if same else "n/a"
        rate = f"{r['tokens_per_s'] / best['tokens_per_s']:.3f}" if best else "n/a"
        mem = r["memory"]
        gib = f"{mem['temp'] / GiB:.2f} / {mem['need'] / GiB:.2f}" if mem else "n/a"
        check = checks.get(f"{r['name']} @{r['rows']}", {})
        verdict = (f"{'ok' if check['ok'] else 'DIFFERS'} ({check['first_step_diff']:.1e}, "
                   f"{check['last_step_diff']:.1e})" if check else "")
        xla = f"{r['mfu_xla_count']:.1%}" if r["mfu_xla_count"] else "n/a"
        losses = r["first_losses"]
        compile_s = f"{r['compile_s']:.0f}{' (alone)' if r['compiled_alone'] else ''}"
        say(f"| {r['name']}: {r['what']} | {r['rows']} x {r['seq']}, {r['k']} | "
            f"{r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu_datasheet']:.1%} | "
            f"{r['mfu_measured_peak']:.1%} | {xla} | {time_ratio} | {rate} | {compile_s} | "
            f"{gib} | {losses[0]:.4f} / {losses[-1]:.4f} | {verdict} |"
            + (f" failed: {r['failed']}" if r["failed"] else ""))


def fit_table(title: str, sides: list[Side], limit: float | None) -> list[dict[str, Any]]:
    """Each side's memory by XLA's analysis against the chip's verdicts."""
    found = []
    say(f"\n#### {title}: XLA's memory analysis against the chip's verdict (limit "
        f"{(limit or math.nan) / GiB:.2f} GiB)\n")
    say("| side | need GiB (temp + arg + out - alias + code) | peak + code GiB (the preflight's "
        "count on a TPU) | temp GiB | compile | first call |\n|---|---:|---:|---:|---|---|")
    for side in sides:
        mem = side.mem
        need = mem.get("need", math.nan) / GiB
        peak = (mem["peak"] + mem["generated_code"]) / GiB if mem.get("peak") else math.nan
        compiled = side.compile_error or ("not compiled" if math.isnan(side.compile_s)
                                          else "ok")
        ran = side.run_verdict
        found.append({"side": side.name, "need_gib": need, "peak_gib": peak, "temp_gib":
                      mem.get("temp", math.nan) / GiB, "compile": compiled, "first_call": ran})
        say(f"| {side.name} | {need:.2f} | {peak:.2f} | {mem.get('temp', math.nan) / GiB:.2f} | "
            f"{compiled[:120]} | {ran[:120]} |")
    return found


# ---- micro: the head's loss and attention alone --------------------------------------------


@dataclasses.dataclass
class Micro:
    name: str
    kind: str  # "head" or "attention"
    shape: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    library: bool  # a choice trainrun's step can take (not a reference)
    choice: Any = None  # (chunk, HeadPath) or AttentionPath
    chunk_bytes: float = 0.0  # a head chunk's float32 logits
    compiled: Any = None
    compile_s: float = math.nan
    error: str | None = None


def head_micros(s: Shape, key: str, tiny: bool) -> list[Micro]:
    tokens = s.batch * s.seq
    draw = np.random.default_rng(0)
    features = jnp.asarray(draw.standard_normal((tokens, s.d_model)), COMPUTE)
    table_ = jnp.asarray(draw.standard_normal((s.vocab, s.d_model)) * 0.02, COMPUTE)
    targets = jnp.asarray(draw.integers(0, s.vocab, tokens), jnp.int32)

    def ours(chunk: int, path: HeadPath) -> Callable[..., Any]:
        return jax.jit(jax.value_and_grad(lambda f, t, targets: next_token_from_features(
            f, t, targets, chunk, path=path)[0], argnums=(0, 1)))

    def plain(f: jax.Array, t: jax.Array, targets: jax.Array) -> jax.Array:
        logits = (f @ t.T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    chunk = s.loss_chunk
    unrolled = HeadPath(unrolled=True)
    chunks = [chunk] if tiny else [c for c in (1024, 2048, 4096, 8192)
                                   if c < tokens and (c >= 2048 or s.vocab > 100_000)]
    cases: list[tuple[str, Callable[..., Any], bool, Any]] = [
        (f"scan, chunk {chunk} (trainrun's plain path)", ours(chunk, PLAIN_HEAD), True,
         (chunk, PLAIN_HEAD)),
        ("plain: full bf16 logits, optax CE", jax.jit(jax.value_and_grad(plain, (0, 1))),
         False, None)]
    cases += [(f"unrolled, chunk {c}", ours(c, unrolled), True, (c, unrolled)) for c in chunks]
    if not tiny:
        cases.append(("one chunk, logits kept (loss_chunk=0)", ours(0, PLAIN_HEAD), False,
                      (0, PLAIN_HEAD)))
    return [Micro(name, "head", key, fn, (features, table_, targets), library, choice,
                  (min(choice[0] or tokens, tokens) * s.vocab * 4.0) if choice else 0.0)
            for name, fn, library, choice in cases]


def attention_micros(s: Shape, key: str, tiny: bool) -> list[Micro]:
    draw = np.random.default_rng(1)
    q = jnp.asarray(draw.standard_normal((s.batch, s.seq, s.heads, s.head_dim)), COMPUTE)
    k, v = (jnp.asarray(draw.standard_normal((s.batch, s.seq, s.kv_heads, s.head_dim)),
                        COMPUTE) for _ in range(2))
    cotangent = jnp.asarray(draw.standard_normal(q.shape), COMPUTE)
    scale = 1.0 / math.sqrt(s.head_dim)

    def ours(path: AttentionPath) -> Callable[..., Any]:
        return jax.jit(jax.value_and_grad(lambda q, k, v, cotangent: jnp.sum(
            causal_attention(q, k, v, scale=scale, path=path).astype(jnp.float32)
            * cotangent), argnums=(0, 1, 2)))

    def grouped(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array) -> jax.Array:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    splashes = [SplashAttention(512, 512, True, seq_minor=""),
                SplashAttention(512, 512, True), SplashAttention(512, 512, False),
                SplashAttention(1024, 1024, True, seq_minor=""),
                SplashAttention(1024, 1024, True), SplashAttention(256, 256, True),
                SplashAttention(1024, 512, True), SplashAttention(512, 1024, True),
                SplashAttention(512, 512, True, block_kv_compute=256),
                SplashAttention(512, 512, True, seq_minor="k"),
                SplashAttention(512, 512, True, seq_minor="qkv")]
    if tiny:
        splashes = [SplashAttention()]
    cases: list[tuple[str, Callable[..., Any], bool, Any]] = [
        ("XLA, k/v repeated (trainrun's plain path)", ours(AttentionPath()), True,
         AttentionPath())]
    if s.kv_heads < s.heads:
        cases.append(("XLA, grouped k/v (the plain step's)",
                      jax.jit(jax.value_and_grad(grouped, (0, 1, 2))), False, None))
    for spec in splashes:
        path = AttentionPath(kernel=spec)
        cases.append((_attention_name(path), ours(path), True, path))
    if not tiny:
        cases.append(("Pallas TPU flash_attention, blocks 512 (k/v repeated)",
                      flash_tpu(q.shape, k.shape[2], scale), False, None))
    return [Micro(name, "attention", key, fn, (q, k, v, cotangent), library, choice)
            for name, fn, library, choice in cases]


def flash_tpu(shape: tuple[int, ...], kv_heads: int, scale: float) -> Callable[..., Any]:
    from jax.experimental.pallas.ops.tpu import flash_attention as flash

    block = min(512, shape[1])
    sizes = flash.BlockSizes(block_q=block, block_k_major=block, block_k=block, block_b=1,
                             block_q_major_dkv=block, block_k_major_dkv=block,
                             block_k_dkv=block, block_q_dkv=block, block_k_major_dq=block,
                             block_k_dq=block, block_q_dq=block)
    group = shape[2] // kv_heads

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, cotangent: jax.Array) -> jax.Array:
        k, v = (jnp.repeat(t, group, axis=2) for t in (k, v))
        out = flash.flash_attention(*(t.transpose(0, 2, 1, 3) for t in (q, k, v)), causal=True,
                                    sm_scale=scale, block_sizes=sizes)
        return jnp.sum(out.transpose(0, 2, 1, 3).astype(jnp.float32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def run_micros(micros: list[Micro], budget: Budget, reps: int, reserve: float
               ) -> list[dict[str, Any]]:
    """Every case lowered here and compiled on the pool, all waited for; then each timed
    (median of ``reps`` calls) and compared with the first case of its kind and shape (the
    plain path)."""

    def compile_one(m: Micro, lowered: Any) -> None:
        start = time.perf_counter()
        m.compiled = lowered.compile()
        m.compile_s = time.perf_counter() - start

    futures = []
    for m in micros:
        try:
            futures.append((m, budget.pool.submit(compile_one, m, m.fn.lower(*m.args))))
        except Exception as err:  # reported with the case's row
            m.error = first_line(err)
    for m, future in futures:
        try:
            future.result(timeout=max(budget.left() - reserve, 1.0))
        except Exception as err:  # a kernel that does not build here is reported, not fatal
            m.error = first_line(err)
    rows: list[dict[str, Any]] = []
    reference: dict[tuple[str, str], Any] = {}
    for m in micros:
        row: dict[str, Any] = {"name": m.name, "kind": m.kind, "shape": m.shape,
                               "library": m.library, "choice": m.choice,
                               "chunk_logits_gib": m.chunk_bytes / GiB}
        rows.append(row)
        try:
            if m.error or m.compiled is None:
                raise RuntimeError(m.error or "not compiled within the time budget")
            value, grads = m.compiled(*m.args)
            jax.block_until_ready(grads)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                jax.block_until_ready(m.compiled(*m.args))
                times.append(time.perf_counter() - start)
        except Exception as err:
            row["failed"] = first_line(err)
            m.compiled, m.args = None, ()
            continue
        row.update(ms=statistics.median(times) * 1e3, compile_s=m.compile_s,
                   memory=memory_of(m.compiled))
        m.compiled, m.args = None, ()  # its program and inputs are not needed again
        got = (float(value), [np.asarray(g, np.float32) for g in grads])
        ref = reference.setdefault((m.kind, m.shape), got)
        scale = [float(np.max(np.abs(g))) or 1.0 for g in ref[1]]
        row["value_diff"] = abs(got[0] - ref[0])
        row["grad_rel_diff"] = max(float(np.max(np.abs(g - r))) / sc
                                   for g, r, sc in zip(got[1], ref[1], scale, strict=True))
        row["ok"] = bool(row["value_diff"] < 2e-2 * max(1.0, abs(ref[0]))
                         and row["grad_rel_diff"] < 5e-2)
    return rows


def micro_table(rows: list[dict[str, Any]], layers: dict[str, int]) -> None:
    say("\n### The head's loss and attention alone (forward and backward)\n")
    say("| shape | what | ms per call | ms per step | compile s | temp GiB | value diff | "
        "grad diff (rel. max) | check |")
    say("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "failed" in r:
            say(f"| {r['shape']} | {r['kind']}: {r['name']} | failed: {r['failed']} ||||||||")
            continue
        per_step = r["ms"] * (layers[r["shape"]] if r["kind"] == "attention" else 1)
        temp = r["memory"].get("temp", math.nan) / GiB
        say(f"| {r['shape']} | {r['kind']}: {r['name']} | {r['ms']:.2f} | {per_step:.1f} | "
            f"{r['compile_s']:.1f} | {temp:.2f} | {r['value_diff']:.1e} | "
            f"{r['grad_rel_diff']:.1e} | {'ok' if r['ok'] else 'DIFFERS'} |")


def fastest(rows: list[dict[str, Any]], kind: str, shape: str) -> Any:
    """The choice of the fastest library case that computes what the plain path computes (a
    head's chunk only where its logits stay within ``CHUNK_LOGITS_BUDGET``)."""
    good = [r for r in rows if r["kind"] == kind and r["shape"] == shape and r["library"]
            and "failed" not in r and r["ok"]
            and r["chunk_logits_gib"] * GiB <= CHUNK_LOGITS_BUDGET]
    return min(good, key=lambda r: r["ms"])["choice"] if good else None


def trace_events(trace_dir: str) -> tuple[list[dict[str, Any]], dict[Any, str]]:
    """The events of the newest perfetto trace under ``trace_dir`` and its processes' names by
    pid (none where no trace was written)."""
    files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
    if not files:
        return [], {}
    with gzip.open(files[-1]) as handle:
        events = json.load(handle)
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, procs


def host_events(trace_dir: str, top: int, hlo_text: str = "") -> list[dict[str, Any]]:
    """The complete events of a trace's host threads summed by name: total time, and self
    time (less the events nested in each on its thread), the ``top`` by self time, then the
    same summed by kind (an instruction's emission, its name's number dropped). An emission
    names its instruction in ``hlo_text``: its shape and the JAX operation it comes from."""
    events, procs = trace_events(trace_dir)
    spans = sorted((e for e in events if e.get("ph") == "X" and "dur" in e
                    and not procs.get(e["pid"], "").startswith("/device:")),
                   key=lambda e: (e["pid"], e.get("tid"), e["ts"], -e["dur"]))
    total: Counter[str] = Counter()
    self_us: Counter[str] = Counter()
    count: Counter[str] = Counter()
    stack: list[tuple[Any, float, str]] = []  # (thread, end, name)
    for e in spans:
        thread, start, end = (e["pid"], e.get("tid")), e["ts"], e["ts"] + e["dur"]
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            stack.pop()
        if stack:
            self_us[stack[-1][2]] -= min(end, stack[-1][1]) - start
        total[e["name"]] += e["dur"]
        self_us[e["name"]] += e["dur"]
        count[e["name"]] += 1
        stack.append((thread, end, e["name"]))
    kinds: Counter[str] = Counter()
    kind_total: Counter[str] = Counter()
    kind_count: Counter[str] = Counter()
    for name, us in self_us.items():
        kind = re.sub(r"\.\d+$", ".*", name)
        kinds[kind] += us
        kind_total[kind] += total[name]
        kind_count[kind] += count[name]

    def instruction(name: str) -> str:
        emitted = re.match(r"XLA::TPU emitting for ([\w.\-]+)$", name)
        if not emitted:
            return ""
        line = re.search(rf"^\s*(?:ROOT\s+)?%?{re.escape(emitted[1])} = (.*)$", hlo_text,
                         re.MULTILINE)
        if not line:
            return ""
        shape = line[1].split("(")[0].strip()
        op = re.search(r'op_name="([^"]*)"', line[1])
        return shape + (" from " + "/".join(op[1].split("/")[-4:]) if op else "")

    return [{"name": name, "self_s": us / 1e6, "total_s": total[name] / 1e6,
             "count": count[name], "instruction": instruction(name)}
            for name, us in self_us.most_common(top)] + [
        {"name": "kind: " + kind, "self_s": us / 1e6, "total_s": kind_total[kind] / 1e6,
         "count": kind_count[kind], "instruction": ""}
        for kind, us in kinds.most_common(top) if kind.endswith(".*")]


# ---- the device's ops, from a profile --------------------------------------------------------


def device_ops(trace_dir: str, steps: int, hlo_text: str, top: int = 15) -> list[dict[str, Any]]:
    """The "XLA Ops" events of the /device:* processes of a perfetto trace, summed per op name,
    per step, each with the JAX operation it comes from (the compiled HLO's metadata). Loops
    show as ``while``: their time holds the ops inside them."""
    events, procs = trace_events(trace_dir)
    device = {p for p, n in procs.items() if n.startswith("/device:")}
    ops = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
           and e.get("name") == "thread_name" and e["pid"] in device
           and e["args"]["name"] == "XLA Ops"}
    total: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in events:
        if e.get("ph") == "X" and (e["pid"], e.get("tid")) in ops:
            total[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    origin = {}
    for m in re.finditer(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"', hlo_text,
                         re.MULTILINE):
        origin[m.group(1)] = "/".join(m.group(2).split("/")[-3:])
    return [{"op": name, "ms_per_step": us / 1e3 / steps, "calls_per_step": calls[name] / steps,
             "from": origin.get(name, "")} for name, us in total.most_common(top)]


def profile(timed: list[Timed], m: Model, budget: Budget, top: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for t in timed:
        directory = tempfile.mkdtemp(prefix="tpu-step-trace-")
        try:
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                t.side.run(m)
            found[t.side.variant.name] = device_ops(directory, t.side.k,
                                                    t.side.compiled.as_text(), top)
        except Exception as err:  # the trace is a report, not a requirement
            budget.note(f"profile of {t.side.name}: none ({first_line(err, 200)})")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    for name, ops in found.items():
        say(f"\n#### Device ops per step: {name}\n")
        if not ops:
            say("(no device ops in the trace: not a TPU)")
            continue
        say("| op | ms/step | calls/step | from |\n|---|---:|---:|---|")
        for op in ops:
            say(f"| {op['op'][:60]} | {op['ms_per_step']:.2f} | {op['calls_per_step']:.1f} | "
                f"{op['from'][:90]} |")
    return found


# ---- the parts --------------------------------------------------------------------------------


def matmul_peak(tiny: bool) -> float:
    n = 512 if tiny else 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    fn = jax.jit(lambda a, b: a @ b).lower(a, a).compile()
    jax.block_until_ready(fn(a, a))
    times = []
    for _ in range(10 if tiny else 30):
        start = time.perf_counter()
        jax.block_until_ready(fn(a, a))
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def init_part(found: dict[str, Shape], models: dict[str, Model], budget: Budget,
              report: Report) -> None:
    """The state at step 0 made three ways at each shape: trainrun's init program (traced,
    lowered, compiled without the algebraic simplifier, run), the same program compiled with
    it, and the builder called op by op (each op's program compiled once per shape, as a
    hand-written eager init runs): seconds of each stage, and whether its bits are trainrun's."""
    say("\n## The state at step 0: trainrun's init program against its alternatives\n")
    say("| shape | how | trace + lower s | compile s | run s | first run s | same bits |")
    say("|---|---|---:|---:|---:|---:|---|")
    rows = []
    for key, s in found.items():
        m = models[key]
        if budget.left() < 60:
            budget.note(f"{s.name}: init not measured (time budget)")
            continue
        jax.clear_caches()
        start = time.perf_counter()
        lowered = init_program(m.model, m.optimizer, 0, m.policy)
        lower_s = time.perf_counter() - start
        ours: Any = None
        for how, options in (("trainrun's init program", INIT_COMPILER_OPTIONS),
                             ("the same, algebraic simplifier on", {})):
            start = time.perf_counter()
            compiled = lowered.compile(compiler_options=options)
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
            state = jax.block_until_ready(compiled())
            run_s = time.perf_counter() - start
            got = jax.device_get(state)
            delete(state)
            same = ours is None or _same_bits(ours, got)
            ours = got if ours is None else ours
            rows.append(dict(shape=s.name, how=how, lower_s=lower_s, compile_s=compile_s,
                             run_s=run_s, same_bits=same))
        build = _state_builder(m.model, m.optimizer, 0, m.policy)
        jax.clear_caches()
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            state = jax.block_until_ready(build())
            runs.append(time.perf_counter() - start)
            got = jax.device_get(state)
            delete(state)
        rows.append(dict(shape=s.name, how="op by op", lower_s=math.nan, compile_s=math.nan,
                         run_s=runs[1], first_run_s=runs[0], same_bits=_same_bits(ours, got)))
        for r in rows[-3:]:
            say(f"| {r['shape']} | {r['how']} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | "
                f"{r['run_s']:.2f} | {r.get('first_run_s', math.nan):.1f} | "
                f"{'yes' if r['same_bits'] else 'no'} |")
        report.data["init"] = rows
        report.save()


def _same_bits(a: Any, b: Any) -> bool:
    def raw(x: Any) -> np.ndarray:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.atleast_1d(np.asarray(x)).view(np.uint8)

    return all(np.array_equal(raw(x), raw(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


PLAIN = Variant("plain", plain=True)
PLAIN_REMAT = Variant("plain, layers rematerialized", plain=True, options=(("remat", True),))


@dataclasses.dataclass
class Report:
    out: Path
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "tpu_step.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "tpu_step.md").write_text("\n".join(SAID) + "\n")


@dataclasses.dataclass
class Plan:
    """What each part runs: its sides, by size, in the order they are tried or timed."""

    gpt2: dict[int, list[Side]] = dataclasses.field(default_factory=dict)
    qwen_trainrun: list[Side] = dataclasses.field(default_factory=list)
    qwen_extra: list[Side] = dataclasses.field(default_factory=list)
    qwen_plain: list[Side] = dataclasses.field(default_factory=list)
    qwen_plain_remat: list[Side] = dataclasses.field(default_factory=list)
    qwen_target: int = 0

    def qwen(self) -> list[Side]:
        return self.qwen_trainrun + self.qwen_extra + self.qwen_plain + self.qwen_plain_remat

    def eager(self) -> Iterator[Side]:
        """The sides compiled before any timing: every one but the 0.5B shape's fallbacks
        (trainrun below its target rows, the plain step's sizes after its first)."""
        for sides in self.gpt2.values():
            yield from sides
        yield from (x for x in self.qwen_trainrun if x.rows >= self.qwen_target)
        yield from self.qwen_extra
        yield from self.qwen_plain[:1]


def parse_sizes(text: str, k: int) -> list[tuple[int, int]]:
    """``8,16`` or ``1x4,1x1``: rows (x K) each."""
    sizes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        rows, _, steps = part.partition("x")
        sizes.append((int(rows), int(steps) if steps else k))
    return sizes


def variants(args: argparse.Namespace, micro: dict[str, Any], found: dict[str, Shape]
             ) -> dict[str, Variant]:
    """trainrun at each shape as the command line, the micro part or trainrun's own choices
    on a TPU say (in that order)."""
    made = {}
    for key, s in found.items():
        picked = micro.get(key, {})
        attention = (attention_choice(getattr(args, f"{key}_attention"))
                     if getattr(args, f"{key}_attention") or "attention" not in picked
                     else picked["attention"])
        head = (head_choice(getattr(args, f"{key}_head"))
                if getattr(args, f"{key}_head") or "head" not in picked else picked["head"])
        chunk = getattr(args, f"{key}_chunk") or picked.get("chunk") or s.loss_chunk
        options: tuple[tuple[str, Any], ...] = (("loss_chunk", chunk),)
        if key == "qwen":
            options += (("scan_layers", args.qwen_layers == "scan"), ("remat", args.qwen_remat))
        made[key] = Variant("trainrun", attention=attention, head=head, options=options)
    return made


def _combined(trainrun: Variant, extras: dict[str, Variant], spec: str) -> Variant:
    """The extra named ``spec``, or for ``a+b`` trainrun with what each of them changes."""
    def named(name: str) -> Variant:  # chunk=N: the head's chunks of N tokens
        if name.startswith("attention="):  # attention=SPEC: as --gpt2-attention takes
            return dataclasses.replace(trainrun, name=f"trainrun, {name}",
                                       attention=attention_choice(name.partition("=")[2]))
        if name.startswith("chunk="):
            return dataclasses.replace(trainrun, name=f"trainrun, {name}", options=(
                *trainrun.options, ("loss_chunk", int(name.removeprefix("chunk=")))))
        if name.startswith("remat="):  # remat=POLICY: each layer rematerialized so
            return dataclasses.replace(trainrun, name=f"trainrun, {name}", options=(
                *trainrun.options, ("remat", name.removeprefix("remat="))))
        return extras[name]

    names = spec.split("+")
    if len(names) == 1:
        return named(spec)
    made = trainrun
    for name in names:
        extra = named(name)
        changed = {f.name: getattr(extra, f.name) for f in dataclasses.fields(extra)
                   if f.name not in ("name", "options")
                   and getattr(extra, f.name) != getattr(trainrun, f.name)}
        made = dataclasses.replace(made, **changed,
                                   options=(*made.options,
                                            *extra.options[len(trainrun.options):]))
    return dataclasses.replace(made, name="trainrun, " + " + ".join(names))


def plan(args: argparse.Namespace, parts: set[str], found: dict[str, Shape],
         models: dict[str, Model], tuned: dict[str, Variant], budget: Budget) -> Plan:
    """Every side lowered (here, in this thread), none compiled yet."""
    p = Plan()
    if "gpt2" in parts:
        s, m, trainrun = found["gpt2"], models["gpt2"], tuned["gpt2"]
        extras = {"select": dataclasses.replace(trainrun, name="trainrun, guard a select",
                                                guard="select"),
                  "none": dataclasses.replace(trainrun, name="trainrun, no guard", guard="none"),
                  "plain-paths": Variant("trainrun, plain paths", guard="select",
                                         norm="concatenated"),
                  "concat-norms": dataclasses.replace(trainrun, name="trainrun, norms concatenated",
                                                      norm="concatenated"),
                  "xla": dataclasses.replace(trainrun, name="trainrun, XLA attention",
                                             attention=PLAIN_ATTENTION),
                  "whole-logits": dataclasses.replace(
                      trainrun, name="trainrun, logits whole",
                      options=(*trainrun.options, ("loss_chunk", 0))),
                  "scan": dataclasses.replace(
                      trainrun, name="trainrun, layers under scan",
                      options=(*trainrun.options, ("scan_layers", True)))}
        for i, (rows, k) in enumerate(parse_sizes(args.gpt2_rows, s.k)):
            wanted = [PLAIN, trainrun] + ([_combined(trainrun, extras, e)
                                           for e in args.gpt2_extra.split(",") if e]
                                          if i == 0 else [])
            p.gpt2[rows] = [x for x in (budget.lower(v, m, rows, k) for v in wanted) if x]
        for rows, k in parse_sizes(args.gpt2_ours_rows, s.k):  # past what the plain step fits
            p.gpt2[rows] = [x for x in [budget.lower(trainrun, m, rows, k)] if x]
    if "qwen" in parts:
        s, m, trainrun = found["qwen"], models["qwen"], tuned["qwen"]
        p.qwen_target = args.qwen_target
        p.qwen_trainrun = [x for x in (budget.lower(trainrun, m, rows, k)
                                       for rows, k in parse_sizes(args.qwen_rows, s.k)) if x]
        extras = {"none": dataclasses.replace(trainrun, name="trainrun, no guard", guard="none"),
                  "select": dataclasses.replace(trainrun, name="trainrun, guard a select",
                                                guard="select")}
        p.qwen_extra = [x for x in (budget.lower(_combined(trainrun, extras, e), m,
                                                 args.qwen_target, s.k)
                                    for e in args.qwen_extra.split(",") if e) if x]
        p.qwen_plain = [x for x in (budget.lower(PLAIN, m, rows, k)
                                    for rows, k in parse_sizes(args.qwen_plain, s.k)) if x]
        p.qwen_plain_remat = [x for x in (budget.lower(PLAIN_REMAT, m, rows, k) for rows, k
                                          in parse_sizes(args.qwen_plain_remat, s.k)) if x]
    return p


def compile_everything(p: Plan, budget: Budget, report: Report, reserve: float,
                       meanwhile: Callable[[], None], alone: int, traced: int = 0) -> None:
    """The first ``alone`` programs at GPT-2's first rows (the plain step's, trainrun's, then
    the extras) one at a time (their compile seconds alone, cold), then every other program on
    the pool (``meanwhile`` run as they compile), all waited for."""
    first = next(iter(p.gpt2.values()), [])[:alone]
    for side in first:
        if traced:
            compile_profiled(side, report, traced)
        else:
            side.compile()
        side.alone = True
        if side.compile_error:
            budget.note(f"{side.name}: compile failed ({side.compile_error})")
    if first:
        say("\ncompiled alone, cold (traced and lowered; compiled): " + "; ".join(
            f"{side.variant.name} {side.lower_s:.1f}; {side.compile_s:.1f} s" for side in first))
        report.data["compile_alone_s"] = {side.variant.name: side.compile_s for side in first}
        report.data["lower_s"] = {side.variant.name: side.lower_s for side in first}
        trips = {side.variant.name: cache_round_trip(side.compiled) for side in first
                 if side.compiled is not None}
        say("what the compile cache adds, done by hand (serialize; zlib compress; MB "
            "compressed; decompress; deserialize and load, s): " + "; ".join(
                f"{name} {t['serialize_s']:.1f}; {t['compress_s']:.1f}; {t['mb']:.0f}; "
                f"{t['decompress_s']:.1f}; {t['load_s']:.1f}" + (
                    f" (zstd: {t['zstd_compress_s']:.1f}; {t['zstd_mb']:.0f}; "
                    f"{t['zstd_decompress_s']:.1f})" if "zstd_mb" in t else "")
                if "mb" in t else f"{name} {t['error']}" for name, t in trips.items()))
        report.data["cache_round_trip"] = trips
    rest = [side for side in p.eager() if side not in first]
    start = time.monotonic()
    budget.compile_all(rest, reserve, meanwhile)
    if rest:
        say(f"the other {len(rest)} programs compiled side by side in "
            f"{time.monotonic() - start:.0f} s ({budget.threads} threads)")


def compile_profiled(side: Side, report: Report, top: int) -> None:
    """``side`` compiled under ``jax.profiler``: its compile's ``top`` host events reported,
    and the compiled program they name kept beside the report."""
    directory = tempfile.mkdtemp(prefix="tpu-step-compile-")
    try:
        with jax.profiler.trace(directory):
            side.compile()
        hlo = side.compiled.as_text() if side.compiled is not None else ""
        events = host_events(directory, top, hlo)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(report.out / f"{side.variant.name}.hlo.txt.gz", "wt") as handle:
        handle.write(hlo)
    report.data.setdefault("compile_events", {})[side.variant.name] = events
    say(f"\n#### The compile's host events: {side.variant.name} ({side.compile_s:.1f} s)"
        "\n\n| event | self s | total s | count | the instruction |\n|---|---:|---:|---:|---|")
    for e in events:
        say(f"| {e['name'][:70]} | {e['self_s']:.2f} | {e['total_s']:.2f} | {e['count']} | "
            f"{e['instruction'][:160]} |")


def cache_round_trip(compiled: Any) -> dict[str, Any]:
    """What JAX's persistent compile cache does to a program on its write and its read,
    timed step by step: the executable serialized and compressed as JAX compresses it without
    zstandard (zlib), then decompressed, deserialized and loaded onto the device."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    try:
        start = time.perf_counter()
        payload, in_tree, out_tree = serialize(compiled)
        serialize_s = time.perf_counter() - start
        start = time.perf_counter()
        packed = zlib.compress(payload)
        compress_s = time.perf_counter() - start
        start = time.perf_counter()
        unpacked = zlib.decompress(packed)
        decompress_s = time.perf_counter() - start
        start = time.perf_counter()
        deserialize_and_load(unpacked, in_tree, out_tree)
        load_s = time.perf_counter() - start
    except Exception as err:  # a backend that cannot serialize: said, not measured
        return {"error": first_line(err, 120)}
    got = {"serialize_s": serialize_s, "compress_s": compress_s, "mb": len(packed) / 1e6,
           "raw_mb": len(payload) / 1e6, "decompress_s": decompress_s, "load_s": load_s}
    try:  # what JAX's cache would do with zstandard installed
        import zstandard  # type: ignore[import-not-found]
    except ImportError:
        return got
    start = time.perf_counter()
    packed = zstandard.ZstdCompressor().compress(payload)
    got["zstd_compress_s"] = time.perf_counter() - start
    start = time.perf_counter()
    zstandard.ZstdDecompressor().decompress(packed)
    got.update(zstd_decompress_s=time.perf_counter() - start, zstd_mb=len(packed) / 1e6)
    return got


def gpt2_part(p: Plan, m: Model, budget: Budget, report: Report, peak: float,
              args: argparse.Namespace) -> None:
    s = m.s
    say(f"\n## {s.name}: {s.seq} tokens a row, K={s.k}, {m.params:,} params\n")
    report.data["gpt2"] = {}
    for i, (rows, sides) in enumerate(p.gpt2.items()):
        sides = [side for side in sides if side.compiled is not None]
        timed = [t for t in (first_call(side, m, budget) for side in sides) if t]
        reserve = 40.0 * (len(p.gpt2) - i - 1) + (100.0 if p.qwen() else 0.0)
        rounds(timed, m, budget, args.rounds, reserve)
        got = results(timed, m, peak)
        checks = loss_checks(got, 0.05)
        table(f"{s.name}, {rows} rows", got, checks, peak)
        entry: dict[str, Any] = {"rows": got, "checks": checks}
        if args.profile and i == 0:
            entry["profile"] = profile(timed, m, budget, args.profile_top)
        report.data["gpt2"][str(rows)] = entry
        report.save()
        for side in sides:
            side.free()
    m.drop()


def qwen_part(p: Plan, m: Model, budget: Budget, report: Report, peak: float,
              args: argparse.Namespace) -> None:
    s = m.s
    say(f"\n## {s.name}: {s.seq} tokens a row, {m.params:,} params\n")
    say("Each contender from its own fresh state (the same init bits), one after another, not "
        "interleaved: the state and one side's temporaries fill most of the chip, everything "
        "of the one before is freed first.")
    got: list[dict[str, Any]] = []

    def attempt(side: Side) -> bool:
        """Compiled (here, if it was not: no timing runs meanwhile), run, timed, freed."""
        gc.collect()
        jax.clear_caches()
        if math.isnan(side.compile_s):
            if budget.left() < 60:
                budget.note(f"{side.name}: not compiled (time budget)")
                return False
            side.compile()
            if side.compile_error:
                budget.note(f"{side.name}: compile failed ({side.compile_error})")
        if side.compiled is None:
            return False
        if budget.left() < 20:
            budget.note(f"{side.name}: not run (time budget)")
            return False
        t = first_call(side, m, budget)
        if t is not None:
            rounds([t], m, budget, max(2, args.rounds // 2), 20.0)
            got.extend(results([t], m, peak))
        m.drop()
        side.free()
        return t is not None

    # the largest that runs of each side before any variant: on the chip a 0.5B compile takes
    # most of a minute, and a budget spent on trainrun's smaller sizes left no plain figure
    for side in p.qwen_trainrun:
        if attempt(side):
            break
    for plain in (p.qwen_plain, p.qwen_plain_remat):
        for side in plain:
            if attempt(side):
                break
    for side in p.qwen_extra:
        attempt(side)
    for name in {side.variant.name for side in p.qwen()} - {r["name"] for r in got}:
        budget.note(f"{s.name}: {name} ran at none of the sizes tried")
    table(f"{s.name}, each contender alone", got, {}, peak)
    fits = fit_table(s.name, p.qwen(), device_limit())
    report.data["qwen"] = {"rows": got, "fit": fits}
    report.save()


def _at_largest(gpt2: dict[str, Any], name: str) -> list[str]:
    """Each side at the largest batch it ran, a step's time per token against the other's."""
    ran = [r for entry in gpt2.values() for r in entry["rows"] if not r["failed"]]
    ours = [r for r in ran if r["name"] == "trainrun"]
    plain = [r for r in ran if r["name"] == PLAIN.name]
    if not ours or not plain:
        return []
    a, b = max(ours, key=lambda r: r["rows"]), max(plain, key=lambda r: r["rows"])
    ratio = b["tokens_per_s"] / a["tokens_per_s"]
    return [f"{name}, each at its largest batch (trainrun {a['rows']} rows, plain {b['rows']}): "
            f"trainrun {ratio:.3f}x the plain step's time a token (target at most 0.8x), "
            f"{a['mfu_datasheet']:.1%} MFU"]


def verdicts(report: Report) -> None:
    """The targets, from what ran."""
    lines = []
    names = {key: shape["name"] for key, shape in report.data["shapes"].items()}
    for rows, entry in sorted(report.data.get("gpt2", {}).items(), key=lambda x: int(x[0])):
        by = {r["name"]: r for r in entry["rows"]}
        if PLAIN.name in by and "trainrun" in by:
            ratio = by["trainrun"]["step_ms"] / by[PLAIN.name]["step_ms"]
            lines.append(f"{names['gpt2']} @{rows}: trainrun {ratio:.3f}x the plain step's time "
                         f"(target at most 0.8x), {by['trainrun']['mfu_datasheet']:.1%} MFU "
                         "(analytic count, 197 TF/s; target 45%)")
    lines += _at_largest(report.data.get("gpt2", {}), names["gpt2"])
    qwen = report.data.get("qwen", {}).get("rows", [])
    ours = [r for r in qwen if r["name"] == "trainrun"]
    plain = max((r for r in qwen if r["name"] in (PLAIN.name, PLAIN_REMAT.name)),
                key=lambda r: r["tokens_per_s"], default=None)
    if ours:
        best = max(ours, key=lambda r: r["tokens_per_s"])
        tokens = max(r["rows"] * r["seq"] for r in ours)
        rate = (f"{best['tokens_per_s'] / plain['tokens_per_s']:.2f}x the plain step's "
                f"best tokens/s ({plain['name']}, {plain['rows']} x {plain['seq']}, "
                f"K={plain['k']})"
                if plain else "the plain step ran at no size tried")
        lines.append(f"{names['qwen']}: trainrun ran {tokens:,} tokens a step; at its best "
                     f"{best['tokens_per_s']:,.0f} tokens/s, {rate} (target 1.25x)")
    if lines:
        say("\n## Against the targets\n")
        for line in lines:
            say(f"- {line}")
    report.data["verdicts"] = lines


def run_parts(args: argparse.Namespace, parts: set[str], budget: Budget, report: Report
              ) -> None:
    device = jax.devices()[0]
    found = shapes(args.tiny)
    say(f"# trainrun's step against a plain-JAX step: {device.device_kind} "
        f"({jax.default_backend()}), jax {jax.__version__}\n")
    if jax.default_backend() != "tpu":
        say("Not a TPU: the Pallas kernels run in their interpreter, fewer configurations; "
            "the figures check the code, they measure nothing.")
    models = {key: Model(s) for key, s in found.items()}
    peak = matmul_peak(args.tiny)
    say(f"bf16 matmul measured here: {peak / 1e12:.3g} TFLOP/s (datasheet "
        f"{PEAK_BF16 / 1e12:.0f})")
    report.data.update(device=device.device_kind, backend=jax.default_backend(),
                       jax=jax.__version__, matmul_tflops=peak / 1e12, parts=sorted(parts),
                       args=vars(args), shapes={k: dataclasses.asdict(v) for k, v in
                                                found.items()})
    report.save()
    micro: dict[str, Any] = {}
    if "micro" in parts:
        kinds = set(args.micro_kinds.split(","))
        cases = [c for key, s in found.items() for c in
                 (head_micros(s, key, args.tiny) if "head" in kinds else [])
                 + (attention_micros(s, key, args.tiny) if "attention" in kinds else [])]
        rows = run_micros(cases, budget, reps=3 if args.tiny else 10, reserve=300.0)
        micro_table(rows, {key: s.layers for key, s in found.items()})
        report.data["micro"] = rows
        for key in found:
            head, attention = fastest(rows, "head", key), fastest(rows, "attention", key)
            micro[key] = {**({"chunk": head[0], "head": head[1]} if head else {}),
                          **({"attention": attention} if attention else {})}
        report.save()
    if "init" in parts:
        init_part(found, models, budget, report)
    tuned = variants(args, micro, found)
    for key in found:
        say(f"\ntrainrun at {found[key].name}: {tuned[key].describe()}")
    p = plan(args, parts, found, models, tuned, budget)

    def states() -> None:  # the states at step 0, made while the pool compiles, kept on the host
        for key in ("gpt2", "qwen"):
            if key in parts:
                models[key].ready()

    compile_everything(p, budget, report, 150.0 if "qwen" in parts else 60.0, states,
                       args.compile_alone, args.compile_profile)
    if p.gpt2:
        gpt2_part(p, models["gpt2"], budget, report, peak, args)
    for sides in p.gpt2.values():  # GPT-2's programs off the chip before the 0.5B shape
        for side in sides:
            side.free()
    if p.qwen():
        qwen_part(p, models["qwen"], budget, report, peak, args)
    verdicts(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="tpu-step-"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget-s", type=float, default=370.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile-threads", type=int, default=7)
    parser.add_argument("--compile-alone", type=int, default=2)
    parser.add_argument("--parts", default="gpt2,qwen")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-top", type=int, default=15)
    parser.add_argument("--compile-profile", type=int, default=0, metavar="TOP")
    parser.add_argument("--micro-kinds", default="head,attention")
    parser.add_argument("--gpt2-rows", default="8,16")
    parser.add_argument("--gpt2-extra", default="select")
    parser.add_argument("--gpt2-ours-rows", default="32")
    parser.add_argument("--qwen-rows", default="8,4,2,1")
    parser.add_argument("--qwen-target", type=int, default=4)
    parser.add_argument("--qwen-extra", default="none")
    parser.add_argument("--qwen-plain", default="1x4,1x1")
    parser.add_argument("--qwen-plain-remat", default="4x4,2x4,1x4")
    parser.add_argument("--qwen-layers", choices=("scan", "unrolled"), default="scan")
    parser.add_argument("--qwen-remat", default="full")
    for key in ("gpt2", "qwen"):
        parser.add_argument(f"--{key}-attention", default=None)
        parser.add_argument(f"--{key}-head", default=None)
        parser.add_argument(f"--{key}-chunk", type=int, default=None)
    args = parser.parse_args()
    if args.tiny:  # toy sizes: rows and K the tiny shapes can take
        args.gpt2_rows = "2,3" if args.gpt2_rows == "8,16" else args.gpt2_rows
        args.gpt2_ours_rows = "4" if args.gpt2_ours_rows == "32" else args.gpt2_ours_rows
        args.qwen_rows = "4,2,1" if args.qwen_rows == "8,4,2,1" else args.qwen_rows
        args.qwen_target = 2 if args.qwen_target == 4 else args.qwen_target
        args.qwen_plain = "1x2,1x1" if args.qwen_plain == "1x4,1x1" else args.qwen_plain
        args.qwen_plain_remat = ("2x2,1x2" if args.qwen_plain_remat == "4x4,2x4,1x4"
                                 else args.qwen_plain_remat)
    jax.config.update("jax_enable_compilation_cache", False)  # compile seconds: cold
    budget = Budget(args.budget_s, args.compile_threads)
    report = Report(Path(args.out))
    started = time.monotonic()
    code = 0
    try:
        run_parts(args, set(args.parts.split(",")), budget, report)
    except Exception:  # whatever was measured is still written
        budget.note("stopped by an error: " + traceback.format_exc()[-2000:])
        code = 1
    report.data["notes"] = budget.notes
    report.data["wall_s"] = time.monotonic() - started
    report.save()
    say(f"\nwall {report.data['wall_s']:.0f} s; JSON: {report.out / 'tpu_step.json'}")
    sys.stdout.flush()
    # compiles still queued or running (sides skipped for time) are not waited for
    os._exit(code)


if __name__ == "__main__":
    main()
