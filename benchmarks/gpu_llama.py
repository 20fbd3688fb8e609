"""Part 6 of ``benchmarks/gpu_lm.sh``: trainrun's step at a Llama shape against PyTorch's on one
GPU, interleaved in one process.

    python benchmarks/gpu_llama.py [--tiny] [--torch-eager] [--budget-s 190] [--out DIR]

The shape is Llama 3.2 1B's: vocabulary 128256, 16 layers, d_model 2048, 32 query heads and 8
key/value heads (grouped-query attention) of 64, a SwiGLU MLP of 8192, RMSNorm (eps 1e-5),
rotary positions with base 500000, the output head tied to the embedding table
(``tie_word_embeddings``): 1.24B params. Sequences of 2048 tokens, 4 a step (8192 tokens): with
float32 masters, AdamW's two moments and the gradients (~20 GB a contender) and each side's
activations this stays well inside its half of an H200 (JAX is held to half by
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 in gpu_lm.sh; PyTorch takes the rest), so neither side needs
remat or activation checkpointing, and neither has it. trainrun's layers are unrolled (no
``scan_layers``), as in Part 2.

trainrun: its own step (``make_train_step``, AdamW, ``Policy(compute=bfloat16)``: float32
master params cast to bfloat16 for the forward and backward pass, the logits and loss in
float32; K steps per jitted call under ``lax.scan``, the state donated), the model built from
the same config fields a run would set: ``model.mlp=swiglu model.norm=rmsnorm model.kv_heads=8
model.head_dim=64 model.mlp_hidden=8192 model.rope_theta=500000``. PyTorch: the same model
written by hand (``torch_llama.py``), trained as ``torch_gpt.py`` trains GPT-2 (torch.compile
of the model, bfloat16 autocast with the residual stream cast to bfloat16 as trainrun's policy
has it, flash SDPA, fused AdamW). One call (K steps) of each contender per round, each ended by
a blocking read; medians over the rounds. Before timing, the two models are checked to compute
the same loss from the same params (float32 and bfloat16, at a toy size).

MFU for both sides from one explicit FLOP count (below, ``flops_per_step``) against the H100/H200
datasheet's 989 TFLOP/s of dense bfloat16.

``--tiny``: toy sizes on a CPU (a check of the code, not a measurement).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gpu_lm import DETERMINISM_OFF, OPTIM, PEAK_BF16, TrainrunSide, hlo_verdict, say

from trainrun.config import TransformerModel
from trainrun.models.transformer import make_transformer
from trainrun.program.precision import Policy


def shape(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"name": "a toy Llama shape (--tiny)", "vocab": 512, "d_model": 64, "layers": 2,
                "heads": 4, "kv_heads": 2, "head_dim": 16, "hidden": 192, "seq_len": 64,
                "rope_theta": 500_000.0, "batch": 4, "k": 2}
    return {"name": "Llama 3.2 1B's shape", "vocab": 128256, "d_model": 2048, "layers": 16,
            "heads": 32, "kv_heads": 8, "head_dim": 64, "hidden": 8192, "seq_len": 2048,
            "rope_theta": 500_000.0, "batch": 4, "k": 5}


def model_options(s: dict[str, Any]) -> dict[str, Any]:
    """trainrun's config fields beyond those ``gpu_lm.TrainrunSide`` sets (vocab, d_model,
    layers, heads, seq_len): what ``model.<field>=...`` overrides would give."""
    return {"kv_heads": s["kv_heads"], "head_dim": s["head_dim"], "mlp": "swiglu",
            "mlp_hidden": s["hidden"], "norm": "rmsnorm", "norm_eps": 1e-5,
            "rope_theta": s["rope_theta"], "tie_embeddings": True}


def torch_shape(s: dict[str, Any]):
    from torch_llama import LlamaShape

    return LlamaShape(vocab=s["vocab"], d_model=s["d_model"], layers=s["layers"],
                      heads=s["heads"], kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                      hidden=s["hidden"], seq_len=s["seq_len"], rope_theta=s["rope_theta"],
                      norm_eps=1e-5, tie_embeddings=True)


def matmul_params(s: dict[str, Any]) -> int:
    """The weights a token's forward pass multiplies by: per layer q (d x heads x head_dim), k
    and v (d x kv_heads x head_dim each), o (heads x head_dim x d), the MLP's gate, up and down
    (3 x d x hidden); and the output head (vocab x d), tied or not. Left out: the embedding
    lookup (a gather, no FLOPs) and the RMSNorm scales (elementwise)."""
    d, inner, kv_inner = s["d_model"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    layer = d * inner + 2 * d * kv_inner + inner * d + 3 * d * s["hidden"]
    return s["layers"] * layer + s["vocab"] * d


def flops_per_step(s: dict[str, Any]) -> float:
    """6 x N x tokens (forward 2, backward 4, per weight and token; N: ``matmul_params``) plus
    attention's 12 x layers x seq x (heads x head_dim) x tokens (QK^T and AV, forward and
    backward, the causal mask not discounted: the convention nanoGPT and PaLM's MFU use). Written
    out here rather than taken from trainrun's reporting so that both contenders are measured
    against the same count whatever that module counts."""
    tokens = s["batch"] * s["seq_len"]
    attention = 12 * s["layers"] * s["seq_len"] * s["heads"] * s["head_dim"] * tokens
    return 6 * matmul_params(s) * tokens + attention


class TorchLlamaSide:
    """The same model in PyTorch (``torch_llama.py``), K steps per call."""

    framework = "pytorch"

    def __init__(self, s: dict[str, Any], eager: bool):
        import torch
        from torch_llama import LlamaTrainer

        self.torch, self.k = torch, s["k"]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        how = "eager" if eager else "torch.compile"
        self.name = f"PyTorch {torch.__version__} ({how}, bf16 autocast, fused AdamW)"
        torch.backends.cuda.matmul.allow_tf32 = True  # as torch_gpt's side (bf16 GEMMs anyway)
        start = time.perf_counter()
        self.trainer = LlamaTrainer(torch_shape(s), device, lr=OPTIM.lr, b1=OPTIM.b1,
                                    b2=OPTIM.b2, weight_decay=OPTIM.weight_decay,
                                    compile=not eager)
        self.params = self.trainer.params
        self.tokens = torch.randint(0, s["vocab"], (self.k, s["batch"], s["seq_len"] + 1),
                                    device=device)
        self.run()  # compiles
        self.compile_s = time.perf_counter() - start

    def run(self) -> float:
        return self.trainer.run(self.tokens)


def same_maths(s: dict[str, Any]) -> list[str]:
    """trainrun's loss and PyTorch's from the same params, float32 and bfloat16, at the toy
    shape with ``s``'s rotary base: the two models are one model."""
    import torch
    from torch_llama import Llama

    toy = {**shape(True), "rope_theta": s["rope_theta"]}
    cfg = TransformerModel(vocab=toy["vocab"], d_model=toy["d_model"], layers=toy["layers"],
                           heads=toy["heads"], seq_len=toy["seq_len"], positions="rope",
                           dropout=0.0, init_std=0.02, **model_options(toy))
    model = make_transformer(cfg)
    params = model.init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, toy["vocab"], (2, toy["seq_len"] + 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def as_torch(x: Any) -> torch.Tensor:
        return torch.tensor(np.asarray(x, np.float32), device=device)

    lines = []
    # float32's tolerance allows for TF32 matmuls on a GPU; bfloat16's for its rounding
    for label, dtype, tolerance in (("float32", None, 2e-3), ("bfloat16", torch.bfloat16, 3e-2)):
        policy = Policy(compute=jnp.float32 if dtype is None else jnp.bfloat16)
        ours = float(model.loss(policy.cast_to_compute(params),
                                {"tokens": jnp.asarray(tokens, jnp.int32)}, None)[0])
        net = Llama(torch_shape(toy), dtype).to(device)
        with torch.no_grad():
            net.embed.weight.copy_(as_torch(params["embed"]["embedding"]))
            net.ln_f.weight.copy_(as_torch(params["ln_f"]["scale"]))
            for i, block in enumerate(net.blocks):
                p = params["blocks"][str(i)]
                block.ln1.weight.copy_(as_torch(p["ln1"]["scale"]))
                block.ln2.weight.copy_(as_torch(p["ln2"]["scale"]))
                block.qkv.weight.copy_(torch.cat([as_torch(p["attn"][n]["kernel"]).T
                                                  for n in "qkv"]))
                block.o.weight.copy_(as_torch(p["attn"]["o"]["kernel"]).T)
                for n in ("gate", "up", "down"):
                    getattr(block, n).weight.copy_(as_torch(p["mlp"][n]["kernel"]).T)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype is not None):
                theirs = float(net(torch.tensor(tokens, device=device)))
        ok = abs(ours - theirs) <= tolerance
        lines.append(f"same params, {label}: trainrun loss {ours:.6f}, PyTorch {theirs:.6f}: "
                     f"{'PASS' if ok else 'FAIL'} (|difference| <= {tolerance:g})")
    return lines


def peak_memory(torch_side: TorchLlamaSide | None) -> str:
    parts = []
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        parts.append(f"JAX {stats['peak_bytes_in_use'] / 2**30:.1f} GiB (all trainrun "
                     "contenders together)")
    if torch_side is not None and torch_side.torch.cuda.is_available():
        parts.append(f"PyTorch {torch_side.torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    return "peak device memory: " + (", ".join(parts) if parts else "n/a (no GPU)")


def bench(args: argparse.Namespace) -> int:
    s = shape(args.tiny)
    if args.k:
        s["k"] = args.k
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    device = jax.devices()[0]
    say(f"{device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    say(f"shape: {s}; time budget {args.budget_s:.0f} s")
    notes: list[str] = []
    try:
        for line in same_maths(s):
            notes.append(line)
            say(line)
    except Exception as err:  # the check is a report; the timing still runs
        notes.append(f"same-maths check not run ({type(err).__name__}: {str(err)[:300]})")
        say(notes[-1])

    sides: list[Any] = []

    def add(make, name: str) -> Any:
        try:
            side = make()
        except Exception as err:  # a contender that cannot be built is reported, not fatal
            notes.append(f"{name}: not run ({type(err).__name__}: {str(err)[:300]})")
            say(notes[-1])
            return None
        sides.append(side)
        say(f"built {side.name}: {side.params:,} params, compile + first call "
            f"{side.compile_s:.1f} s")
        return side

    options = model_options(s)
    base = add(lambda: TrainrunSide("trainrun (GPU defaults: deterministic)", s, **options),
               "trainrun")
    if base is None:
        return 1
    torch_side = add(lambda: TorchLlamaSide(s, args.torch_eager), "PyTorch")
    if torch_side is None and not args.torch_eager:
        torch_side = add(lambda: TorchLlamaSide(s, True), "PyTorch eager")
    times: dict[str, list[float]] = collections.defaultdict(list)
    losses: dict[str, float] = {}

    def rounds(count: int) -> None:
        for _ in range(count):
            for side in sides:
                start = time.perf_counter()
                losses[side.name] = side.run()
                times[side.name].append((time.perf_counter() - start) / side.k)

    rounds(2)
    hlo = hlo_verdict(base.fn.as_text())
    report(s, base, sides, times, losses, notes, hlo, torch_side, out,
           "first two rounds; the final table follows if the time budget allows")
    # One more trainrun contender at most: a third ~20 GB state would not fit JAX's half.
    if deadline - time.monotonic() < 1.5 * base.compile_s + 10:
        notes.append("trainrun, deterministic mode off: skipped (time budget)")
        say(notes[-1])
    else:
        add(lambda: TrainrunSide("trainrun, deterministic mode off", s, DETERMINISM_OFF,
                                 **options), "trainrun, deterministic mode off")
    round_s = sum(statistics.median(times[x.name]) * x.k if times[x.name] else 10.0
                  for x in sides)
    done = min(len(v) for v in times.values())
    while done < args.rounds and (done < 3 or deadline - time.monotonic() > round_s):
        rounds(1)
        done = min(len(times[x.name]) for x in sides)
    report(s, base, sides, times, losses, notes, hlo, torch_side, out, "final")
    return 0


def report(s: dict[str, Any], base: TrainrunSide, sides: list[Any],
           times: dict[str, list[float]], losses: dict[str, float], notes: list[str],
           hlo: dict[str, str], torch_side: TorchLlamaSide | None, out: Path,
           when: str) -> None:
    """Part 6's table (and llama.json) from the rounds so far."""
    flops = flops_per_step(s)  # one count for every contender
    tokens = s["batch"] * s["seq_len"]
    results = []
    for side in sides:
        t = times[side.name]
        step_s = statistics.median(t) if t else float("nan")
        results.append({"name": side.name, "framework": side.framework, "params": side.params,
                        "compile_s": side.compile_s, "step_s": step_s, "rounds": len(t),
                        "step_s_all": t, "tokens_per_s": tokens / step_s,
                        "mfu": flops / step_s / PEAK_BF16, "last_loss": losses.get(side.name)})
    torch_s = next((r["step_s"] for r in results if r["framework"] == "pytorch"), None)
    say(f"\n## Part 6: trainrun's step vs PyTorch at {s['name']}, {s['batch']} x "
        f"{s['seq_len']} tokens a step, K={s['k']} steps per call, interleaved, median of "
        f"{min(r['rounds'] for r in results)}+ rounds ({when})\n")
    say("| contender | params | compile+first call s | ms/step | tokens/s | MFU (989 TF/s) | "
        "trainrun/PyTorch time | last loss |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ratio = f"{r['step_s'] / torch_s:.2f}x" if torch_s else "n/a"
        loss = f"{r['last_loss']:.3f}" if r["last_loss"] is not None else "n/a"
        say(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['compile_s']:.0f} | "
            f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {ratio} | "
            f"{loss} |")
    say(f"\nFLOPs per step (both sides): {flops / 1e12:.3f} T = 6 x {matmul_params(s):,} "
        f"matmul params x {tokens:,} tokens + 12 x layers x seq x heads x head_dim x tokens "
        f"(attention); ln(vocab) = {math.log(s['vocab']):.2f} (random tokens: the loss stays "
        "near it)")
    say(peak_memory(torch_side))
    for key, value in hlo.items():
        say(f"- trainrun's step, {key}: {value}")
    for note in notes:
        say(f"- {note}")
    (out / "llama.json").write_text(json.dumps({"shape": s, "results": results, "notes": notes,
                                                "hlo": hlo, "flops_per_step": flops,
                                                "when": when}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--budget-s", type=float, default=190.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--k", type=int, default=0, help="steps per call (default: 5, tiny 2)")
    parser.add_argument("--torch-eager", action="store_true")
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu-llama-"))
    return bench(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
