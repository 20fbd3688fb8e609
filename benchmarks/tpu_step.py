"""trainrun's training step against a plain-JAX step written here, on one TPU chip (or, with
``--tiny``, on any backend at toy sizes: a check of the code, not a measurement).

    python benchmarks/tpu_step.py --out DIR [--tiny] [--budget-s 470] [--profile]
                                  [--parts micro,gpt2,attribution,qwen,search,extra]

Both sides train the same model from the same params on the same random tokens: trainrun's
``make_train_step`` with its transformer and AdamW, and a plain step written below (optax
AdamW, ``jax.nn.dot_product_attention``, full logits and optax's cross-entropy); bfloat16
compute on float32 masters, K steps per jitted call under ``lax.scan``, the state donated.
Every contender of a shape shares one state on the device (the plain step takes trainrun's
params and AdamW state, whose layout it shares), so the chip holds one state whatever the
number of contenders; each contender's first call starts from the same fresh state, and their
losses are compared (the plain side's against trainrun's: the same maths).

Parts, most important first, each compiled only while the time budget allows:

  micro   the head's loss (fused forward kernel, chunks unrolled or scanned, chunk sizes) and
          causal attention (XLA's, Pallas splash attention at several blocks, Pallas flash
          attention) alone, forward and backward, at both shapes: time, compiled memory, and
          their values and gradients against the plain path's
  gpt2    GPT-2 small (vocabulary 50304, 12 x 768, 12 heads, rope, tied head), 8 x 1024 tokens,
          K=10: the plain step, trainrun as it was, trainrun tuned (the fastest head and
          attention of ``micro``), interleaved rounds (one call of each, a blocking read,
          medians)
  attribution  in the same rounds, trainrun with the tuned head alone and the tuned
          attention alone
  qwen    a Qwen2.5-0.5B shape (vocabulary 151936, 24 layers, d_model 896, 14 query and 2
          key/value heads, SwiGLU 4864, RMSNorm, q/k/v biases, tied head), 2048 tokens a row:
          the plain step and trainrun tuned (layers under scan, rematerialized), each at the
          largest batch of rows it fits
  search  the largest batch each side fits at GPT-2 small, found by compiling only (XLA's
          memory analysis against the chip's ``bytes_limit``), then timed there
  extra   trainrun tuned without the non-finite guard, and with its layers under scan, at
          GPT-2 small; at the 0.5B shape, trainrun tuned without remat

Reported: ms/step, tokens/s, MFU against 197 TFLOP/s (v5e's datasheet) and against a bfloat16
8192^3 matmul measured in this process, by one analytic FLOP count for both sides (6 x params x
tokens + 12 x layers x seq x width x tokens) and by XLA's count of each program (trainrun's own
count; a Pallas kernel's FLOPs are not in it); compile seconds (cold: no compilation cache;
compiles run on a pool of host threads, ``--compile-threads``, so each figure is a compile
beside up to that many others); compiled memory. ``--profile``: one call of the plain step,
trainrun as it was and trainrun tuned under ``jax.profiler``, the device's ops summed per step.
A markdown report on stdout and in OUT/tpu_step.md; every figure in OUT/tpu_step.json (both
written again as each part ends, so a run stopped early keeps what it measured).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
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
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.fast.head_kernel import FusedHeadForward
from trainrun.fast.tpu_attention import SplashAttention
from trainrun.models.losses import PLAIN_HEAD, HeadPath, next_token_from_features
from trainrun.models.transformer import (
    PLAIN_ATTENTION,
    AttentionPath,
    causal_attention,
    make_transformer,
)
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import Policy
from trainrun.program.state import abstract_state, init_state
from trainrun.program.step import make_multi_step, make_train_step

PEAK_BF16 = 197e12  # TPU v5e datasheet, dense bfloat16
OPTIM = OptimizerConfig(name="adamw", lr=6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
COMPUTE = jnp.bfloat16
MiB, GiB = 2**20, 2**30
MEMORY_MARGIN = 0.03  # of the device's memory, left free when a batch is said to fit


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
    batch: int  # rows of the main comparison
    k: int  # steps per call
    batches: tuple[int, ...]  # rows the largest-batch search may pick from
    mlp: str = "gelu"
    norm: str = "layernorm"
    eps: float = 1e-5
    rope_theta: float = 10_000.0
    qkv_bias: bool = False
    loss_chunk: int = 4096

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
            "gpt2": Shape("gpt2-tiny", 512, 128, 2, 2, 2, 512, 128, 2, 2, (2, 3, 4, 6),
                          loss_chunk=128),
            "qwen": Shape("qwen-tiny", 1000, 128, 2, 4, 2, 256, 128, 2, 2, (1, 2, 3, 4),
                          mlp="swiglu", norm="rmsnorm", eps=1e-6, rope_theta=1e6,
                          qkv_bias=True, loss_chunk=128),
        }
    return {
        "gpt2": Shape("GPT-2 small", 50304, 768, 12, 12, 12, 3072, 1024, 8, 10,
                      (8, 12, 16, 24, 32)),
        "qwen": Shape("Qwen2.5-0.5B shape", 151936, 896, 24, 14, 2, 4864, 2048, 4, 4,
                      (1, 2, 3, 4, 6, 8), mlp="swiglu", norm="rmsnorm", eps=1e-6,
                      rope_theta=1e6, qkv_bias=True),
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


def plain_loss(p: Any, tokens: jax.Array, s: Shape) -> jax.Array:
    """The model's mean next-token cross-entropy, written plainly over trainrun's params."""
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

    for i in range(s.layers):
        block = p["blocks"][str(i)]
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
        x = x + _linear(h, mlp["down"])
    x = _norm(x, p["ln_f"], s.norm, s.eps)
    logits = x @ table.T
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           targets).mean()


def plain_optimizer() -> optax.GradientTransformation:
    return optax.adamw(OPTIM.lr, b1=OPTIM.b1, b2=OPTIM.b2, eps=OPTIM.eps,
                       weight_decay=OPTIM.weight_decay,
                       mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))


def plain_multi_step(s: Shape) -> Callable[..., Any]:
    tx = plain_optimizer()

    def step(carry: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state = carry
        loss, grads = jax.value_and_grad(lambda p: plain_loss(
            jax.tree.map(lambda x: x.astype(COMPUTE), p), tokens, s))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return lambda carry, batches: jax.lax.scan(step, carry, batches)


# ---- contenders ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """A contender: the plain step, or trainrun's with a head path, an attention path and
    model options (``loss_chunk``, ``scan_layers``, ``remat``); ``guard=False`` drops the
    non-finite guard (a measurement of what it costs, not an option of trainrun's)."""

    name: str
    plain: bool = False
    attention: AttentionPath = PLAIN_ATTENTION
    head: HeadPath = PLAIN_HEAD
    options: tuple[tuple[str, Any], ...] = ()
    guard: bool = True

    def describe(self) -> str:
        if self.plain:
            return "plain JAX (optax AdamW, XLA attention, full bf16 logits, optax CE)"
        parts = [_attention_name(self.attention), _head_name(self.head)]
        parts += [f"{k}={v}" for k, v in self.options]
        return ", ".join(parts) + ("" if self.guard else ", no non-finite guard")


def _attention_name(path: AttentionPath) -> str:
    kernel = path.kernel
    if isinstance(kernel, SplashAttention):
        return (f"splash {kernel.block_q}x{kernel.block_kv}"
                f"{' fused bwd' if kernel.fused_backward else ''}")
    return "XLA attention"


def _head_name(path: HeadPath) -> str:
    if path.plain():
        return "head scanned"
    name = "head unrolled"
    if isinstance(path.forward, FusedHeadForward):
        name += f" + fused fwd {path.forward.block_tokens}x{path.forward.block_vocab}"
    return name + (" + table grad once" if path.table_grad_once else "")


def no_guard(finite: jax.Array, new: Any, old: Any) -> Any:
    return new


class Shared:
    """One state for every contender of a shape: trainrun's ``TrainState``; the plain step
    takes its params and AdamW state. Its shapes are known without allocating it; the device
    holds it only while its shape is timed. ``fresh``: the state at step 0, each time the
    same (the first init is kept on the host)."""

    def __init__(self, s: Shape):
        self.model, self.optimizer = make_transformer(s.config()), build_optimizer(OPTIM)
        self.policy = Policy(compute=COMPUTE)
        self.abstract = abstract_state(self.model, self.optimizer, 0, self.policy)
        self.params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract.params))
        plain_state = jax.eval_shape(plain_optimizer().init, self.abstract.params)
        if jax.tree.structure(plain_state) != jax.tree.structure(self.abstract.opt_state):
            raise RuntimeError("the plain AdamW state is not laid out as trainrun's")
        self.state: Any = None
        self.initial: Any = None

    def ready(self) -> None:
        """The state at step 0 made once (here: every trace stays in the main thread), kept in
        host memory."""
        if self.initial is None:
            state = init_state(self.model, self.optimizer, seed=0, policy=self.policy)
            self.initial = jax.device_get(state)
            for leaf in jax.tree.leaves(state):
                leaf.delete()

    def fresh(self) -> None:
        self.drop()
        self.ready()
        self.state = jax.device_put(self.initial)

    def drop(self) -> None:
        for leaf in jax.tree.leaves(self.state):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        self.state = None


class Side:
    """A contender lowered at one batch (here, in the calling thread), compiled by
    ``compile`` (on the pool); ``run`` takes the shared state through one call of K steps and
    returns the losses."""

    def __init__(self, variant: Variant, s: Shape, batch: int, shared: Shared):
        self.variant, self.s, self.batch, self.k = variant, s, batch, s.k
        self.name = f"{s.name}: {variant.name} @{batch}"
        tokens = jax.ShapeDtypeStruct((s.k, batch, s.seq + 1), jnp.int32)
        start = time.perf_counter()
        if variant.plain:
            fn = jax.jit(plain_multi_step(s), donate_argnums=0)
            self.lowered = fn.lower((shared.abstract.params, shared.abstract.opt_state), tokens)
        else:
            model = make_transformer(s.config(**dict(variant.options)), variant.attention,
                                     variant.head)
            step = make_train_step(model, build_optimizer(OPTIM), policy=shared.policy,
                                   **({} if variant.guard else {"keep": no_guard}))
            fn = jax.jit(make_multi_step(step), donate_argnums=0)
            self.lowered = fn.lower(shared.abstract, {"tokens": tokens})
        self.lower_s = time.perf_counter() - start
        self.compiled: Any = None
        self.compile_s = math.nan
        self.tokens: Any = None
        self.shape = tokens

    def compile(self) -> Side:
        start = time.perf_counter()
        self.compiled = self.lowered.compile()
        self.compile_s = time.perf_counter() - start
        self.lowered = None  # its text is large and no longer needed
        return self

    def memory(self) -> dict[str, float]:
        return memory_of(self.compiled)

    def run(self, shared: Shared) -> np.ndarray:
        if self.tokens is None:  # the same tokens for every contender of a shape and batch
            self.tokens = jax.random.randint(jax.random.key(2), self.shape.shape, 0,
                                             self.s.vocab, jnp.int32)
        if self.variant.plain:
            state = shared.state
            (params, opt_state), losses = self.compiled((state.params, state.opt_state),
                                                        self.tokens)
            shared.state = state.replace(params=params, opt_state=opt_state)
        else:
            shared.state, metrics = self.compiled(shared.state, {"tokens": self.tokens})
            losses = metrics["loss"]
        jax.block_until_ready(shared.state)
        return np.asarray(losses, np.float32)


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
    got["need"] = max(got["peak"], got["argument"] + got["output"] - got["alias"]
                      + got["temp"]) + got["generated_code"]
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


# ---- the compile pool and the budget --------------------------------------------------------


class Budget:
    """The time left, and the pool of threads the programs compile on (XLA compiles outside
    Python's lock, so they overlap each other and the timing on the chip). Programs are
    lowered in the main thread and submitted in the order they matter."""

    def __init__(self, seconds: float, threads: int):
        self.deadline = time.monotonic() + seconds
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self.notes: list[str] = []
        self.jobs: dict[tuple[str, str, int], concurrent.futures.Future[Side]] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"- {text}")

    def add(self, variant: Variant, s: Shape, batch: int, shared: Shared) -> None:
        """Lower ``variant`` at ``batch`` here and queue its compile (once)."""
        key = (s.name, variant.name, batch)
        if key in self.jobs:
            return
        try:
            side = Side(variant, s, batch, shared)
        except Exception as err:
            self.note(f"{s.name}: {variant.name} @{batch}: not traced ({type(err).__name__}: "
                      f"{str(err)[:400]})")
            return
        self.jobs[key] = self.pool.submit(side.compile)

    def get(self, variant: Variant, s: Shape, batch: int, reserve: float = 0.0) -> Side | None:
        """The compiled side, or None (a note says why) if it failed or was not done while
        the budget, less ``reserve`` seconds kept for what follows, lasted."""
        future = self.jobs.get((s.name, variant.name, batch))
        if future is None:
            return None
        name = f"{s.name}: {variant.name} @{batch}"
        try:
            return future.result(timeout=max(self.left() - reserve, 0.0))
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.note(f"{name}: not compiled within the time budget; skipped")
        except Exception as err:  # a contender that cannot be built is reported, not fatal
            self.note(f"{name}: compile failed ({type(err).__name__}: {str(err)[:400]})")
        self.jobs.pop((s.name, variant.name, batch))
        return None


# ---- timing ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Timed:
    side: Side
    first_losses: list[float]
    times: list[float] = dataclasses.field(default_factory=list)
    failed: str | None = None


def first_calls(contenders: list[list[Side]], shared: Shared, budget: Budget) -> list[Timed]:
    """Each contender's first call from the same fresh state (its K losses kept): the check
    that the contenders compute the same maths. A contender is a list of sides, the next
    tried where one fails to run (a batch too large after all)."""
    timed = []
    for sides in contenders:
        for side in sides:
            try:
                shared.fresh()
                losses = side.run(shared)
            except Exception as err:  # RESOURCE_EXHAUSTED and the like: reported, not fatal
                text = str(err).strip().splitlines() or [""]
                budget.note(f"{side.name}: failed at its first call ({type(err).__name__}: "
                            f"{text[0][:300]})")
                continue
            timed.append(Timed(side, [float(x) for x in losses]))
            break
    return timed


def interleave(timed: list[Timed], shared: Shared, budget: Budget, rounds: int,
               reserve: float) -> None:
    """Rounds of one call of each contender, each ended by a blocking read; at least two
    rounds, then more while the budget (less ``reserve``) allows."""
    done = 0
    while done < rounds:
        round_s = sum(statistics.median(t.times) * t.side.k if t.times else 5.0 for t in timed)
        if done >= 2 and budget.left() - reserve < round_s:
            budget.note(f"timing stopped after {done} rounds (time budget)")
            break
        for t in timed:
            if t.failed:
                continue
            start = time.perf_counter()
            try:
                t.side.run(shared)
            except Exception as err:
                t.failed = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                shared.fresh()
                continue
            t.times.append((time.perf_counter() - start) / t.side.k)
        done += 1


def results(timed: list[Timed], shared: Shared, peak: float) -> list[dict[str, Any]]:
    rows = []
    for t in timed:
        side, s = t.side, t.side.s
        step_s = statistics.median(t.times) if t.times else math.nan
        tokens = side.batch * s.seq
        flops = s.flops_per_token(shared.params) * tokens
        counted = xla_flops(side.compiled)
        mem = side.memory()
        rows.append({
            "name": side.variant.name, "what": side.variant.describe(), "batch": side.batch,
            "seq": s.seq, "k": side.k, "compile_s": side.compile_s, "lower_s": side.lower_s,
            "step_ms": step_s * 1e3, "step_ms_all": [x * 1e3 for x in t.times],
            "rounds": len(t.times), "tokens_per_s": tokens / step_s,
            "mfu_datasheet": flops / step_s / PEAK_BF16, "mfu_measured_peak": flops / step_s / peak,
            "xla_flops_per_step": counted,
            "mfu_xla_count": (counted / step_s / PEAK_BF16) if counted else None,
            "memory": mem, "first_losses": t.first_losses, "failed": t.failed,
        })
    return rows


def loss_checks(rows: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Each contender's first-call losses against trainrun's as it was (or the first one):
    the same params, tokens and maths, so they differ by rounding alone."""
    if not rows:
        return {}
    base = next((r for r in rows if r["name"] == "trainrun"), rows[0])
    checks = {}
    for r in rows:
        a, b = np.asarray(r["first_losses"]), np.asarray(base["first_losses"])
        first, last = abs(a[0] - b[0]), abs(a[-1] - b[-1])
        checks[r["name"]] = {"first_step_diff": float(first), "last_step_diff": float(last),
                             "against": base["name"], "ok": bool(first < tolerance)}
    return checks


def table(title: str, rows: list[dict[str, Any]], checks: dict[str, Any], peak: float) -> None:
    if not rows:
        say(f"\n### {title}\n\nnothing ran")
        return
    plain = next((r for r in rows if r["name"] == PLAIN.name), None)
    say(f"\n### {title}\n")
    say("| contender | rows x seq | ms/step | tokens/s | MFU (197 TF/s) | MFU (measured "
        f"{peak / 1e12:.3g} TF/s) | MFU by XLA's count | time / plain's | tokens/s / plain's | "
        "compile s | compiled GiB (temp / need) | loss step 0 / K-1 | first-call check |")
    say("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        same = plain is not None and plain["batch"] == r["batch"]
        time_ratio = f"{r['step_ms'] / plain['step_ms']:.3f}" if plain and same else "n/a"
        rate = f"{r['tokens_per_s'] / plain['tokens_per_s']:.3f}" if plain else "n/a"
        mem = r["memory"]
        gib = (f"{mem['temp'] / GiB:.2f} / {mem['need'] / GiB:.2f}" if mem else "n/a")
        check = checks.get(r["name"], {})
        verdict = (f"{'ok' if check['ok'] else 'DIFFERS'} ({check['first_step_diff']:.1e}, "
                   f"{check['last_step_diff']:.1e})" if check else "")
        xla = f"{r['mfu_xla_count']:.1%}" if r["mfu_xla_count"] else "n/a"
        losses = r["first_losses"]
        say(f"| {r['name']}: {r['what']} | {r['batch']} x {r['seq']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['mfu_datasheet']:.1%} | "
            f"{r['mfu_measured_peak']:.1%} | {xla} | {time_ratio} | {rate} | "
            f"{r['compile_s']:.0f} | {gib} | {losses[0]:.4f} / {losses[-1]:.4f} | {verdict} |"
            + (f" failed: {r['failed']}" if r["failed"] else ""))


# ---- micro: the head's loss and attention alone --------------------------------------------


@dataclasses.dataclass
class Micro:
    name: str
    kind: str  # "head" or "attention"
    shape: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    library: bool  # a choice trainrun's step can take (not a reference)
    choice: Any = None  # the HeadPath or AttentionPath it stands for
    compiled: Any = None
    compile_s: float = math.nan
    done_at: float = math.nan  # time.monotonic() when its compile ended


def head_micros(s: Shape, key: str, interpret_only_one: bool) -> list[Micro]:
    tokens = s.batch * s.seq
    draw = np.random.default_rng(0)
    features = jnp.asarray(draw.standard_normal((tokens, s.d_model)), COMPUTE)
    table = jnp.asarray(draw.standard_normal((s.vocab, s.d_model)) * 0.02, COMPUTE)
    targets = jnp.asarray(draw.integers(0, s.vocab, tokens), jnp.int32)

    def ours(chunk: int, path: HeadPath) -> Callable[..., Any]:
        return jax.jit(jax.value_and_grad(lambda f, t, targets: next_token_from_features(
            f, t, targets, chunk, path=path)[0], argnums=(0, 1)))

    def plain(f: jax.Array, t: jax.Array, targets: jax.Array) -> jax.Array:
        logits = (f @ t.T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    chunk = s.loss_chunk
    unrolled = HeadPath(unrolled=True)
    kernels = [FusedHeadForward(1024, 512), FusedHeadForward(512, 1024),
               FusedHeadForward(1024, 2048)]
    if interpret_only_one:
        kernels = [FusedHeadForward(128, 256)]
    cases: list[tuple[str, Callable[..., Any], bool, Any]] = [
        (f"scan, chunk {chunk} (trainrun as it was)", ours(chunk, PLAIN_HEAD), True,
         (chunk, PLAIN_HEAD)),
        ("plain: full bf16 logits, optax CE", jax.jit(jax.value_and_grad(plain, (0, 1))),
         False, None),
        (f"unrolled, chunk {chunk}", ours(chunk, unrolled), True, (chunk, unrolled)),
        (f"unrolled + table grad once, chunk {chunk}",
         ours(chunk, HeadPath(unrolled=True, table_grad_once=True)), True,
         (chunk, HeadPath(unrolled=True, table_grad_once=True))),
    ]
    if not interpret_only_one:  # chunk sizes: on the chip only
        cases += [
            (f"unrolled, chunk {2 * chunk}", ours(2 * chunk, unrolled), True,
             (2 * chunk, unrolled)),
            (f"unrolled, chunk {chunk // 2}", ours(chunk // 2, unrolled), True,
             (chunk // 2, unrolled)),
            ("one chunk, logits kept (loss_chunk=0)", ours(0, PLAIN_HEAD), False,
             (0, PLAIN_HEAD))]
    for kernel in kernels:
        path = HeadPath(unrolled=True, forward=kernel)
        cases.append((f"fused fwd {kernel.block_tokens}x{kernel.block_vocab}, unrolled bwd "
                      f"chunk {chunk}", ours(chunk, path), True, (chunk, path)))
    return [Micro(name, "head", key, fn, (features, table, targets), library, choice)
            for name, fn, library, choice in cases]


def attention_micros(s: Shape, key: str, interpret_only_one: bool) -> list[Micro]:
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

    splashes = [SplashAttention(512, 512, True), SplashAttention(512, 512, False),
                SplashAttention(1024, 1024, True), SplashAttention(256, 256, True),
                SplashAttention(1024, 512, True)]
    if interpret_only_one:
        splashes = [SplashAttention(128, 128, True)]
    cases: list[tuple[str, Callable[..., Any], bool, Any]] = [
        ("XLA, k/v repeated (trainrun as it was)", ours(AttentionPath()), True,
         AttentionPath())]
    if s.kv_heads < s.heads:
        cases.append(("XLA, grouped k/v (the plain step's)",
                      jax.jit(jax.value_and_grad(grouped, (0, 1, 2))), False, None))
    for spec in splashes:
        path = AttentionPath(kernel=spec)
        cases.append((_attention_name(path), ours(path), True, path))
    if not interpret_only_one:
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


def queue_micros(micros: list[Micro], budget: Budget) -> list[concurrent.futures.Future[Any]]:
    """Each case lowered here, compiled on the pool."""

    def compile_one(m: Micro, lowered: Any) -> Micro:
        start = time.perf_counter()
        m.compiled = lowered.compile()
        m.compile_s = time.perf_counter() - start
        m.done_at = time.monotonic()
        return m

    futures = []
    for m in micros:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            lowered = m.fn.lower(*m.args)  # type: ignore[attr-defined]
        except Exception as err:  # reported with the case's row
            future.set_exception(err)
        else:
            future = budget.pool.submit(compile_one, m, lowered)
        futures.append(future)
    return futures


def run_micros(micros: list[Micro], futures: list[concurrent.futures.Future[Any]],
               budget: Budget, reps: int) -> list[dict[str, Any]]:
    """Time each case (median of ``reps`` calls) and compare its value and gradients with the
    first case of its kind and shape (the plain path)."""
    rows: list[dict[str, Any]] = []
    reference: dict[tuple[str, str], Any] = {}
    for m, future in zip(micros, futures, strict=True):
        row: dict[str, Any] = {"name": m.name, "kind": m.kind, "shape": m.shape,
                               "library": m.library, "choice": m.choice}
        rows.append(row)
        try:
            future.result(timeout=max(budget.left() - 330, 1.0))
            value, grads = m.compiled(*m.args)
            jax.block_until_ready(grads)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                jax.block_until_ready(m.compiled(*m.args))
                times.append(time.perf_counter() - start)
        except Exception as err:  # a kernel that does not build here is reported, not fatal
            future.cancel()
            m.compiled, m.args = None, ()
            text = str(err).strip().splitlines() or [""]
            row["failed"] = f"{type(err).__name__}: {text[0][:300]}"
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


def compile_overlap(micros: list[Micro], queued: float) -> float:
    """Seconds of compiling over the seconds from queueing to the last compile's end: how
    many compiles ran at once on average."""
    ended = [m.done_at for m in micros if math.isfinite(m.done_at)]
    if not ended:
        return math.nan
    return sum(m.compile_s for m in micros if math.isfinite(m.done_at)) / max(
        max(ended) - queued, 1e-9)


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
    """The choice of the fastest library case that computes what the plain path computes."""
    good = [r for r in rows if r["kind"] == kind and r["shape"] == shape and r["library"]
            and "failed" not in r and r["ok"]]
    return min(good, key=lambda r: r["ms"])["choice"] if good else None


# ---- the device's ops, from a profile --------------------------------------------------------


def device_ops(trace_dir: str, steps: int, hlo_text: str, top: int = 15) -> list[dict[str, Any]]:
    """The "XLA Ops" events of the /device:* processes of a perfetto trace, summed per op name,
    per step, each with the JAX operation it comes from (the compiled HLO's metadata). Loops
    show as ``while``: their time holds the ops inside them."""
    files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
    if not files:
        return []
    with gzip.open(files[-1]) as handle:
        events = json.load(handle)
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
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


def profile(timed: list[Timed], shared: Shared, budget: Budget) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for t in timed:
        directory = tempfile.mkdtemp(prefix="tpu-step-trace-")
        try:
            with jax.profiler.trace(directory, create_perfetto_trace=True):
                t.side.run(shared)
            found[t.side.variant.name] = device_ops(directory, t.side.k,
                                                    t.side.compiled.as_text())
        except Exception as err:  # the trace is a report, not a requirement
            budget.note(f"profile of {t.side.name}: none ({type(err).__name__}: "
                        f"{str(err)[:200]})")
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


# ---- the largest batch that fits ------------------------------------------------------------


def device_limit(override_gib: float | None) -> float | None:
    if override_gib:
        return override_gib * GiB
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats["bytes_limit"]) if "bytes_limit" in stats else None


def largest(variant: Variant, s: Shape, probes: tuple[int, ...], shared: Shared,
            budget: Budget, limit: float | None, reserve: float
            ) -> tuple[list[Side], dict[int, float], float]:
    """The largest of ``s.batches`` whose program fits ``limit`` bytes (less a margin), by
    compiling only: the ``probes`` (queued already), then the largest batch a straight line
    through their memory predicts, then one step down at a time. Returned with the smaller
    fitting batches compiled on the way, largest first, to fall back on. Without a limit (a
    backend that has none) the search runs against 1.6 x the smallest probe's need: a check
    of the search itself."""
    needs: dict[int, float] = {}
    sides: dict[int, Side] = {}

    def measure(batch: int) -> None:
        side = budget.get(variant, s, batch, reserve)
        if side is not None:
            sides[batch], needs[batch] = side, side.memory().get("need", math.inf)

    for batch in probes:
        measure(batch)
    if not needs:
        return [], needs, limit or math.nan
    limit = limit or 1.6 * needs[min(needs)]
    usable = limit * (1 - MEMORY_MARGIN)
    fitting = [b for b in needs if needs[b] <= usable]
    guess = max(fitting, default=min(s.batches))
    low, high = min(needs), max(needs)
    if high > low:  # memory is near linear in the rows: the line through two probes
        slope = (needs[high] - needs[low]) / (high - low)
        guess = max([guess] + [b for b in s.batches if needs[low] + slope * (b - low) <= usable])
    for batch in sorted(s.batches, reverse=True):
        if batch > guess or (fitting and batch <= max(fitting)):
            continue
        if batch not in needs:
            if budget.left() - reserve < 60:
                budget.note(f"{s.name}: {variant.name}: search stopped at {batch} rows (time "
                            "budget)")
                break
            budget.add(variant, s, batch, shared)
            measure(batch)
        if needs.get(batch, math.inf) <= usable:
            fitting.append(batch)
            break
    return [sides[b] for b in sorted(fitting, reverse=True)], needs, limit


def searched(s: Shape, sides: dict[str, tuple[list[Side], dict[int, float], float]]
             ) -> dict[str, Any]:
    found = {}
    for name, (fitting, needs, limit) in sides.items():
        best = fitting[0].batch if fitting else None
        found[name] = {"needs_gib": {b: n / GiB for b, n in sorted(needs.items())},
                       "largest": best, "limit_gib": limit / GiB}
        say(f"- {s.name}, {name}: compiled memory need by rows (GiB, of {limit / GiB:.2f}): "
            + ", ".join(f"{b}: {n / GiB:.2f}" for b, n in sorted(needs.items()))
            + f"; the largest batch that fits: {best or 'none'}")
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


PLAIN = Variant("plain", plain=True)
TODAY = Variant("trainrun")  # the plain paths: trainrun as it was
# trainrun's own choices on a TPU (fast/strategies.py), where the micro part measured none
LIBRARY_HEAD = HeadPath(unrolled=True, forward=FusedHeadForward())
LIBRARY_ATTENTION = AttentionPath(kernel=SplashAttention())


@dataclasses.dataclass
class Report:
    out: Path
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "tpu_step.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "tpu_step.md").write_text("\n".join(SAID) + "\n")


def timed_table(key: str, title: str, contenders: list[list[Side]], shared: Shared,
                budget: Budget, report: Report, peak: float, rounds: int, reserve: float,
                check: bool = True) -> list[Timed]:
    """First calls, interleaved rounds, the table and the report's entry ``key``."""
    timed = first_calls(contenders, shared, budget)
    interleave(timed, shared, budget, rounds, reserve)
    rows = results(timed, shared, peak)
    checks = loss_checks(rows, 0.05) if check else {}
    table(title, rows, checks, peak)
    report.data[key] = {**report.data.get(key, {}), "rows": rows, "checks": checks}
    report.save()
    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="tpu-step-"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget-s", type=float, default=470.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--compile-threads", type=int, default=4)
    parser.add_argument("--parts", default="micro,gpt2,attribution,qwen,search,extra")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="the device memory the search fits against (default: the "
                        "device's bytes_limit)")
    args = parser.parse_args()
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
    # compiles still queued or running (contenders skipped for time) are not waited for
    os._exit(code)


def run_parts(args: argparse.Namespace, parts: set[str], budget: Budget, report: Report
              ) -> None:
    device = jax.devices()[0]
    found = shapes(args.tiny)
    gpt2, qwen = found["gpt2"], found["qwen"]
    interpret = jax.default_backend() != "tpu"
    say(f"# trainrun's step against a plain-JAX step: {device.device_kind} "
        f"({jax.default_backend()}), jax {jax.__version__}\n")
    if interpret:
        say("Not a TPU: the Pallas kernels run in their interpreter, fewer configurations; "
            "the figures check the code, they measure nothing.")
    shared = {key: Shared(s) for key, s in found.items()}
    peak = matmul_peak(args.tiny)
    say(f"bf16 matmul measured here: {peak / 1e12:.3g} TFLOP/s (datasheet "
        f"{PEAK_BF16 / 1e12:.0f})")
    report.data.update(device=device.device_kind, backend=jax.default_backend(),
                       jax=jax.__version__, matmul_tflops=peak / 1e12, parts=sorted(parts),
                       shapes={k: dataclasses.asdict(v) for k, v in found.items()})
    report.save()
    micros: list[Micro] = []
    if "micro" in parts:  # queued first: small programs, and they choose the tuned paths
        for key, s in found.items():
            micros += head_micros(s, key, interpret) + attention_micros(s, key, interpret)
        queued = time.monotonic()
        micro_futures = queue_micros(micros, budget)
    if parts & {"gpt2", "attribution", "extra"}:
        for variant in (PLAIN, TODAY):
            budget.add(variant, gpt2, gpt2.batch, shared["gpt2"])
    for key in found:  # while the pool compiles
        shared[key].ready()
    tuned = {key: (s.loss_chunk, LIBRARY_HEAD, LIBRARY_ATTENTION) for key, s in found.items()}
    if micros:
        rows = run_micros(micros, micro_futures, budget, reps=3 if args.tiny else 10)
        overlap = compile_overlap(micros, queued)
        report.data["compile_overlap"] = overlap
        say(f"\ncompile pool: {overlap:.1f} compiles at once on average over the micro part's "
            f"{len(micros)} programs ({args.compile_threads} threads)")
        if overlap < 1.5 and args.compile_threads > 1:  # one at a time: keep what matters
            parts -= {"attribution", "extra"}
            budget.note("compiles did not overlap: the attribution and extra parts are dropped")
        micros.clear()
        micro_table(rows, {key: s.layers for key, s in found.items()})
        report.data["micro"] = rows
        report.save()
        for key in found:
            head = fastest(rows, "head", key)
            attention = fastest(rows, "attention", key)
            tuned[key] = (*(head or tuned[key][:2]), attention or LIBRARY_ATTENTION)
    best = Variant("trainrun tuned", attention=tuned["gpt2"][2], head=tuned["gpt2"][1],
                   options=(("loss_chunk", tuned["gpt2"][0]),))
    qwen_best = Variant("trainrun tuned", attention=tuned["qwen"][2], head=tuned["qwen"][1],
                        options=(("loss_chunk", tuned["qwen"][0]), ("scan_layers", True),
                                 ("remat", "full")))
    qwen_kept = dataclasses.replace(qwen_best, name="trainrun tuned, no remat",
                                    options=qwen_best.options[:2])
    say(f"\ntrainrun tuned: {best.describe()} ({gpt2.name}); {qwen_best.describe()} "
        f"({qwen.name})")
    attribution = [variant for variant, differs in (
        (Variant("trainrun, head only", head=best.head, options=best.options),
         best.head != TODAY.head or best.options[0][1] != gpt2.loss_chunk),
        (Variant("trainrun, attention only", attention=best.attention),
         best.attention != TODAY.attention)) if differs]
    extras = [dataclasses.replace(best, name="trainrun tuned, no guard", guard=False),
              dataclasses.replace(best, name="trainrun tuned, scan_layers",
                                  options=(*best.options, ("scan_layers", True)))]
    # every program queued now, in the order it matters; each part waits for its own
    if parts & {"gpt2", "attribution", "extra"}:
        budget.add(best, gpt2, gpt2.batch, shared["gpt2"])
    if "attribution" in parts:
        for variant in attribution:
            budget.add(variant, gpt2, gpt2.batch, shared["gpt2"])
    probes = {PLAIN.name: (1, 2), qwen_best.name: (qwen.batch, 2 * qwen.batch),
              qwen_kept.name: (1, 2)}
    qwen_sides = [PLAIN, qwen_best] + [qwen_kept] * ("extra" in parts)
    if "qwen" in parts:
        for variant in qwen_sides:
            for batch in probes[variant.name]:
                budget.add(variant, qwen, batch, shared["qwen"])
    gpt2_probes = (gpt2.batches[0], gpt2.batches[2])
    if "search" in parts:
        for variant in (PLAIN, best):
            for batch in gpt2_probes:
                budget.add(variant, gpt2, batch, shared["gpt2"])
    if "extra" in parts:
        for variant in extras:
            budget.add(variant, gpt2, gpt2.batch, shared["gpt2"])

    if parts & {"gpt2", "attribution"}:
        say(f"\n## {gpt2.name}: {gpt2.batch} x {gpt2.seq} tokens a step, K={gpt2.k}, "
            f"{shared['gpt2'].params:,} params\n")
        sides = [x for x in (budget.get(v, gpt2, gpt2.batch, 150)
                             for v in [PLAIN, TODAY, best, *attribution]) if x]
        timed = timed_table("gpt2", f"{gpt2.name}, {gpt2.batch} rows", [[x] for x in sides],
                            shared["gpt2"], budget, report, peak, args.rounds, 180)
        if args.profile:
            report.data["gpt2"]["profile"] = profile(
                [t for t in timed if t.side.variant.name in (PLAIN.name, TODAY.name, best.name)],
                shared["gpt2"], budget)
            report.save()
        shared["gpt2"].drop()
    if "qwen" in parts:
        say(f"\n## {qwen.name}: {qwen.seq} tokens a row, K={qwen.k}, "
            f"{shared['qwen'].params:,} params\n")
        limit = device_limit(args.memory_limit_gib)
        found_q = {v.name: largest(v, qwen, probes[v.name], shared["qwen"], budget, limit, 80)
                   for v in qwen_sides}
        report.data["qwen"] = {"search": searched(qwen, found_q)}
        sides = [fitting for fitting, _, _ in found_q.values() if fitting]
        timed = timed_table("qwen", f"{qwen.name}, each at the largest batch it fits", sides,
                            shared["qwen"], budget, report, peak, max(2, args.rounds // 2),
                            60, check=False)
        if args.profile and budget.left() > 60:
            report.data["qwen"]["profile"] = profile(timed, shared["qwen"], budget)
            report.save()
        shared["qwen"].drop()
    if "search" in parts:
        say(f"\n## {gpt2.name}: the largest batch each side fits\n")
        limit = device_limit(args.memory_limit_gib)
        found_g = {v.name: largest(v, gpt2, gpt2_probes, shared["gpt2"], budget, limit, 30)
                   for v in (PLAIN, best)}
        report.data["gpt2_search"] = {"search": searched(gpt2, found_g)}
        sides = [fitting for fitting, _, _ in found_g.values() if fitting]
        timed_table("gpt2_search", f"{gpt2.name}, each at the largest batch it fits", sides,
                    shared["gpt2"], budget, report, peak, max(2, args.rounds // 2), 25,
                    check=False)
        shared["gpt2"].drop()
    if "extra" in parts and budget.left() > 20:
        sides = [x for x in (budget.get(v, gpt2, gpt2.batch, 15) for v in [TODAY, best, *extras])
                 if x]
        if len(sides) > 2:
            timed_table("gpt2_extra", f"{gpt2.name}, {gpt2.batch} rows: what the non-finite "
                        "guard and scan_layers cost", [[x] for x in sides], shared["gpt2"],
                        budget, report,
                        peak, max(2, args.rounds // 2), 5)
        shared["gpt2"].drop()


if __name__ == "__main__":
    main()
