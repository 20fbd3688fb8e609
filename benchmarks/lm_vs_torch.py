"""A byte-level GPT trained by trainrun and by PyTorch eager, side by side in one process.

    python benchmarks/lm_vs_torch.py [--rounds 10] [--k 4] [--torch-threads 2,1]
    python benchmarks/lm_vs_torch.py --ablation [--rounds 8]

Both sides train the same model (d_model 256, 4 layers, 4 heads, sequence 256, batch 16, vocab
256: 3.2M parameters; pre-LayerNorm, rotary positions, tanh-GELU MLP, tied embeddings, no
biases in the matmuls; normal init with std 0.02, and 0.02/sqrt(2 x layers) on the residual
projections) with the same AdamW (decay on matrices only), on the same batches of Python
standard-library source bytes. The trainrun column is trainrun's own step: ``make_train_step``
with its transformer and optimizer, jitted with the state donated, as the loop runs it, with
the process settings ``trainrun train`` makes (``trainrun.configure_process``). PyTorch
runs once per thread count asked for (all cores is its default; one thread is its better
setting when the cores are shared with other work).

``--ablation`` times trainrun's step against itself with one change undone at a time, and the
plain transcription of the model (``trainrun.models.reference``) under XLA's default
flags: what each change is worth.

Timing: contenders (and a 2048-square float32 matmul through XLA, the machine's ceiling) run
interleaved, one step each per round, each ended by a blocking read; the table shows medians
over the rounds: wall time, the process's CPU time and its minor page faults (memory the
allocator handed back and took again: each 4 KB page costs a fault and a zeroing). On a
shared machine absolute times move with the load; the interleaved ratios hold.

FLOPs per step are the model's, the same for every contender: 6 x params x tokens for the
weights plus 12 x layers x seq x d_model x tokens for attention (the causal mask not discounted,
the usual MFU convention), so a contender that skips masked attention work gets no credit for
the work it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import trainrun.models.transformer as transformer
from trainrun import extras
from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.models.adapters import Model
from trainrun.models.reference import plain_loss  # the plain transcription of the model
from trainrun.platform.process import configure_process
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import make_multi_step, make_train_step

# trainrun's process settings (XLA flags, allocator, CPU dispatch), made before JAX starts its
# backend (nothing above starts it), as `trainrun train` makes them.
configure_process()

MODEL = TransformerModel(vocab=256, d_model=256, layers=4, heads=4, seq_len=256,
                         positions="rope", dropout=0.0, init_std=0.02)
BATCH = 16
OPTIM = OptimizerConfig(name="adamw", lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
# jaxlib 0.10.2's own choice of YNNPACK fusions (checked: the same compiled step as no flag)
XLA_DEFAULT_YNN = {"xla_cpu_experimental_ynn_fusion_type": ",".join(
    f"LIBRARY_FUSION_TYPE_{kind}" for kind in ("INDIVIDUAL_DOT", "INDIVIDUAL_CONVOLUTION",
                                               "REDUCE"))}


# ---- data: the same byte windows for every contender -------------------------------------------


def corpus(limit: int = 8 << 20) -> np.ndarray:
    """Up to ``limit`` bytes of the standard library's .py files, in sorted path order."""
    chunks, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], np.uint8)


def batches(text: np.ndarray, count: int, seed: int = 0) -> np.ndarray:
    """``[count, BATCH, seq_len + 1]`` random windows of ``text`` (int32 token ids)."""
    rng = np.random.default_rng(seed)
    width = MODEL.seq_len + 1
    starts = rng.integers(0, len(text) - width, (count, BATCH))
    return text[starts[..., None] + np.arange(width)].astype(np.int32)


def model_flops_per_step() -> float:
    d, layers, t = MODEL.d_model, MODEL.layers, MODEL.seq_len
    params = MODEL.vocab * d + layers * (12 * d * d + 4 * d) + 2 * d
    tokens = BATCH * t
    return 6 * params * tokens + 12 * layers * t * d * tokens


# ---- trainrun ------------------------------------------------------------------------------------


class TrainrunSide:
    """A model's step through trainrun's ``make_train_step`` and optimizer, jitted with the state
    donated, ``k`` steps per call; compiled here (under ``patches``, with ``compiler_options``)."""

    def __init__(self, name: str, model: Model | None = None, k: int = 1,
                 compiler_options: dict[str, Any] | None = None,
                 patches: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.name, self.k = name, k
        with patches():
            model = model or transformer.make_transformer(MODEL)
            optimizer = build_optimizer(OPTIM)
            step = make_train_step(model, optimizer)
            self.state = init_state(model, optimizer, seed=0)
            shape = (k, BATCH, MODEL.seq_len + 1) if k > 1 else (BATCH, MODEL.seq_len + 1)
            tokens = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32)}
            fn = jax.jit(make_multi_step(step) if k > 1 else step, donate_argnums=0)
            self.fn = fn.lower(self.state, tokens).compile(compiler_options=compiler_options)

    def step(self, tokens: np.ndarray) -> float:
        """One call on ``[k, B, T+1]`` tokens; the last step's loss (a blocking read)."""
        self.state, metrics = self.fn(self.state, {"tokens": tokens if self.k > 1 else tokens[0]})
        return float(np.asarray(metrics["loss"]).reshape(-1)[-1])


# ---- PyTorch -------------------------------------------------------------------------------------


def torch_model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads, layers = MODEL.d_model, MODEL.heads, MODEL.layers
    head_dim, std = d // heads, MODEL.init_std

    def linear(d_in: int, d_out: int, scale: float) -> nn.Linear:
        layer = nn.Linear(d_in, d_out, bias=False)
        nn.init.normal_(layer.weight, std=scale)
        return layer

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
            self.q, self.k, self.v = (linear(d, d, std) for _ in range(3))
            self.o = linear(d, d, std / math.sqrt(2 * layers))
            self.up = linear(d, MODEL.mlp_ratio * d, std)
            self.down = linear(MODEL.mlp_ratio * d, d, std / math.sqrt(2 * layers))

        def forward(self, x, sin, cos):
            b, t, _ = x.shape
            h = self.ln1(x)

            def heads_of(proj, rotate):
                y = proj(h).view(b, t, heads, head_dim)
                if rotate:  # rotary positions, the same halves convention as trainrun's
                    y1, y2 = y[..., : head_dim // 2], y[..., head_dim // 2:]
                    y = torch.cat([y1 * cos - y2 * sin, y1 * sin + y2 * cos], dim=-1)
                return y.transpose(1, 2)

            a = F.scaled_dot_product_attention(heads_of(self.q, True), heads_of(self.k, True),
                                               heads_of(self.v, False), is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(MODEL.vocab, d)
            nn.init.normal_(self.embed.weight, std=std)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d, eps=1e-5)
            freqs = 10_000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            angles = torch.arange(MODEL.seq_len, dtype=torch.float32)[:, None] * freqs[None]
            self.register_buffer("sin", torch.sin(angles)[:, None, :])
            self.register_buffer("cos", torch.cos(angles)[:, None, :])

        def forward(self, tokens):
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            x = self.embed(inputs)
            for block in self.blocks:
                x = block(x, self.sin, self.cos)
            logits = self.ln_f(x) @ self.embed.weight.T
            return F.cross_entropy(logits.reshape(-1, MODEL.vocab), targets.reshape(-1))

    return GPT()


class TorchSide:
    """The same model in PyTorch eager with ``torch.optim.AdamW``, run on ``threads`` threads."""

    def __init__(self, threads: int):
        import torch

        self.torch, self.threads = torch, threads
        self.name = f"PyTorch {torch.__version__} eager, {threads} thread(s)"
        self.k = 1
        torch.manual_seed(0)
        self.model = torch_model()
        params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIM.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=OPTIM.lr, betas=(OPTIM.b1, OPTIM.b2), eps=OPTIM.eps)

    def step(self, tokens: np.ndarray) -> float:
        self.torch.set_num_threads(self.threads)
        for batch in tokens:
            loss = self.model(self.torch.from_numpy(batch).long())
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return loss.item()


# ---- the ceiling ---------------------------------------------------------------------------------


class Ceiling:
    """A 2048-square float32 matmul through XLA: this machine's dense FLOP/s, timed alongside."""

    size = 2048

    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(1))
        self.a = jax.random.normal(k1, (self.size, self.size), jnp.float32)
        self.b = jax.random.normal(k2, (self.size, self.size), jnp.float32)
        self.fn = jax.jit(jnp.matmul)
        self.fn(self.a, self.b).block_until_ready()

    def flops_per_s(self) -> float:
        start = time.perf_counter()
        self.fn(self.a, self.b).block_until_ready()
        return 2 * self.size**3 / (time.perf_counter() - start)


# ---- ablation: trainrun's transformer with one change undone ----------------------------------


@contextlib.contextmanager
def patched(owner: Any = transformer, **attrs: Any) -> Iterator[None]:
    """Replace attributes of ``owner`` (the transformer module) while a step is traced."""
    saved = {name: getattr(owner, name) for name in attrs}
    for name, value in attrs.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def _attention_3d(self, x, rope, cache=None, pos=0):
    b, c, d = x.shape  # the training path only, on [batch, seq, d_model] activations
    q, k, v = (proj(x).reshape(b, c, self.heads, d // self.heads)
               for proj in (self.q, self.k, self.v))
    q, k = rope.apply(q), rope.apply(k)
    return self.o(transformer.causal_attention(q, k, v).reshape(b, c, d)), cache


def _mlp_3d(self, x):
    return self.down(jax.nn.gelu(self.up(x), approximate=True))


def _loss_with_traced_positions(module, batch, key, chunk=0):
    tokens = batch["tokens"]  # pos as an array: the rotary table is computed in the program
    features, _ = module.features(tokens[:, :-1], key, pos=jnp.zeros((), jnp.int32))
    return transformer.next_token_from_features(features, module.embed.embedding[...],
                                                tokens[:, 1:].reshape(-1), chunk)


@contextlib.contextmanager
def matmuls_3d() -> Iterator[None]:
    with (patched(transformer.Attention, __call__=_attention_3d),
          patched(transformer.MLP, __call__=_mlp_3d)):
        yield


def ablation_sides() -> list[TrainrunSide]:
    def dot_product_attention(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def plain_model() -> Model:
        base = transformer.make_transformer(MODEL)
        return Model(init=base.init, name="plain",
                     loss=lambda params, batch, key: (plain_loss(MODEL, params, batch), {}))

    return [
        TrainrunSide("trainrun (every change)"),
        TrainrunSide("  XLA's default YNNPACK fusions", compiler_options=XLA_DEFAULT_YNN),
        TrainrunSide("  jax.nn.dot_product_attention",
                     patches=lambda: patched(causal_attention=dot_product_attention)),
        TrainrunSide("  rotary table computed in the step",
                     patches=lambda: patched(_lm_loss=_loss_with_traced_positions)),
        TrainrunSide("  matmuls on [batch, seq, d] (3-D)", patches=matmuls_3d),
        TrainrunSide("plain transcription, XLA defaults", model=plain_model(),
                     compiler_options=XLA_DEFAULT_YNN),
    ]


# ---- the run -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed calls per contender")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contender")
    parser.add_argument("--k", type=int, default=1,
                        help="also time trainrun with K steps per call (lax.scan); per-step times")
    parser.add_argument("--torch-threads", default=f"{os.cpu_count()},1",
                        help="PyTorch thread counts, one contender each (default: all cores, 1)")
    parser.add_argument("--ablation", action="store_true",
                        help="trainrun's step with one change undone at a time (no PyTorch)")
    args = parser.parse_args()
    if not args.ablation and not extras.installed("bench"):
        print("error: " + extras.message("bench", "the PyTorch side"), file=sys.stderr)
        sys.exit(2)

    if args.ablation:
        sides: list[Any] = ablation_sides()
    else:
        sides = [TrainrunSide("trainrun")]
        if args.k > 1:
            sides.append(TrainrunSide(f"trainrun, K={args.k} steps per call", k=args.k))
        sides += [TorchSide(int(n)) for n in args.torch_threads.split(",") if n]
    k = max(side.k for side in sides)
    data = batches(corpus(), (args.warmup + args.rounds) * k)
    ceiling = Ceiling()
    wall: dict[str, list[float]] = {side.name: [] for side in sides}
    cpu: dict[str, list[float]] = {side.name: [] for side in sides}
    faults: dict[str, list[float]] = {side.name: [] for side in sides}
    losses: dict[str, list[float]] = {side.name: [] for side in sides}
    peak: list[float] = []
    for i in range(args.warmup + args.rounds):
        chunk = data[i * k:(i + 1) * k]
        for side in sides:
            start, start_cpu = time.perf_counter(), time.process_time()
            start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for j in range(0, k, side.k):  # every contender trains on the same k batches
                losses[side.name].append(side.step(chunk[j:j + side.k]))
            if i >= args.warmup:
                wall[side.name].append((time.perf_counter() - start) / k)
                cpu[side.name].append((time.process_time() - start_cpu) / k)
                faults[side.name].append(
                    (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults) / k)
        if i >= args.warmup:
            peak.append(ceiling.flops_per_s())
        print(f"  round {i:3d}  " + "  ".join(f"{losses[s.name][-1]:.3f}" for s in sides),
              file=sys.stderr)
    report(sides, wall, cpu, faults, losses, statistics.median(peak), args)


def report(sides: list[Any], wall: dict[str, list[float]], cpu: dict[str, list[float]],
           faults: dict[str, list[float]], losses: dict[str, list[float]], peak: float,
           args: argparse.Namespace) -> None:
    flops = model_flops_per_step()
    tokens = BATCH * MODEL.seq_len
    median = {name: statistics.median(times) for name, times in wall.items()}
    torch_names = [s.name for s in sides if isinstance(s, TorchSide)]
    reference = min(torch_names, key=median.get) if torch_names else sides[0].name
    versus = "vs best PyTorch" if torch_names else "vs first row"
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nbyte LM d={MODEL.d_model} L={MODEL.layers} H={MODEL.heads} T={MODEL.seq_len} "
          f"B={BATCH}: {flops / 1e9:.1f} GFLOP/step (model FLOPs); ceiling: 2048^2 fp32 "
          f"matmul through XLA, median {peak / 1e9:.1f} GFLOP/s; jax {jax.__version__}; "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {args.rounds} interleaved rounds, "
          f"medians; load average at the end {load} on {os.cpu_count()} CPUs\n")
    print(f"| {'contender':42s} | s/step | tokens/s | {versus} | GFLOP/s | of ceiling | "
          f"CPU s/step | page faults/step | loss first -> last |")
    print(f"|{'-' * 44}|-------:|---------:|{'-' * (len(versus) + 1)}:|--------:|-----------:|"
          f"-----------:|-----------------:|-------------------:|")
    for side in sides:
        t, name = median[side.name], side.name
        print(f"| {name:42s} | {t:6.3f} | {tokens / t:8,.0f} | "
              f"{median[reference] / t:{len(versus) - 1}.2f}x | {flops / t / 1e9:7.1f} | "
              f"{flops / t / peak:9.0%} | {statistics.median(cpu[name]):10.3f} | "
              f"{statistics.median(faults[name]):16,.0f} | "
              f"{losses[name][0]:.3f} -> {losses[name][-1]:.3f} |")


if __name__ == "__main__":
    main()
