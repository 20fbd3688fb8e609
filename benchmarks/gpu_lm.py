"""The pieces of ``benchmarks/gpu_lm.sh``: trainrun's LM step against PyTorch's on one GPU, where
the step's time goes, what the training loop adds, and GPU determinism checks.

    python benchmarks/gpu_lm.py bench [--tiny] [--budget-s 140] [--out DIR]
    python benchmarks/gpu_lm.py scatter [--tiny] [--out DIR]
    python benchmarks/gpu_lm.py tokens PATH COUNT VOCAB
    python benchmarks/gpu_lm.py same RUN_DIR RUN_DIR
    python benchmarks/gpu_lm.py loop RUN_DIR BENCH_JSON

``bench``: the GPT-2-small shape (vocabulary 50304, 12 layers, d_model 768, 12 heads, sequence
1024, batch 32: 123.6M parameters) trained by trainrun's own step (``make_train_step`` with its
transformer and AdamW, bfloat16 compute on float32 masters, K steps per jitted call under
``lax.scan``, the state donated) and by the same model in PyTorch as nanoGPT trains it
(``torch_gpt.py``: torch.compile, bfloat16 autocast, flash SDPA, fused AdamW), in one process,
interleaved: one call (K steps) of each contender per round, each ended by a blocking read;
medians over the rounds. Contenders past the first two (trainrun with XLA's deterministic mode
off, with ``scan_layers``, with ``remat``) are compiled only while the time budget allows. Then
a ``jax.profiler`` trace of one call of trainrun's step, summarized per kernel
(``gpu_kernels.py``), and its compiled HLO read for the dtypes of its GEMMs and for cuDNN's fused
attention. MFU for both sides from the same analytic FLOP count (6 x params x tokens + 12 x
layers x seq x d_model x tokens, the causal mask not discounted) against the H100/H200
datasheet's 989 TFLOP/s of dense bfloat16.

``scatter``: the embedding gradient (a scatter-add of 32,768 rows with repeated indices) under
trainrun's GPU defaults against a float64 NumPy reference and against XLA's atomic scatter
(deterministic mode off): correct, bitwise repeatable, and its cost.

``--tiny``: every size small enough for a CPU (a check of the code, not a measurement).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.models.transformer import make_transformer
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import Policy
from trainrun.program.step import make_multi_step, make_train_step
from trainrun.reporting.sinks.jsonl import read_metrics

try:
    from trainrun.program.state import init_state
except ImportError:  # a checkout from before init_state moved from trainrun.training.loop
    from trainrun.training.loop import init_state

PEAK_BF16 = 989e12  # H100/H200 SXM datasheet, dense bfloat16
OPTIM = OptimizerConfig(name="adamw", lr=6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
# trainrun's GPU determinism defaults undone for one compilation (trainrun.platform.process)
DETERMINISM_OFF = {"xla_gpu_deterministic_ops": False, "xla_gpu_enable_triton_gemm": True,
                   "xla_gpu_enable_scatter_determinism_expander": False}


def shape(tiny: bool) -> dict[str, int]:
    if tiny:
        return {"vocab": 512, "d_model": 64, "layers": 2, "heads": 2, "seq_len": 64,
                "batch": 4, "k": 2}
    return {"vocab": 50304, "d_model": 768, "layers": 12, "heads": 12, "seq_len": 1024,
            "batch": 32, "k": 10}


def model_flops_per_step(params: int, s: dict[str, int]) -> float:
    tokens = s["batch"] * s["seq_len"]
    return 6 * params * tokens + 12 * s["layers"] * s["seq_len"] * s["d_model"] * tokens


def say(text: str = "") -> None:
    print(text, flush=True)


# ---- the contenders ------------------------------------------------------------------------------


class TrainrunSide:
    """trainrun's step, jitted with the state donated, K steps per call; compiled here."""

    framework = "trainrun"

    def __init__(self, name: str, s: dict[str, int], compiler_options: dict | None = None,
                 **model_options: Any):
        self.name, self.k = name, s["k"]
        cfg = TransformerModel(vocab=s["vocab"], d_model=s["d_model"], layers=s["layers"],
                               heads=s["heads"], seq_len=s["seq_len"], positions="rope",
                               dropout=0.0, init_std=0.02, **model_options)
        model, optimizer = make_transformer(cfg), build_optimizer(OPTIM)
        policy = Policy(compute=jnp.bfloat16)
        self.state = init_state(model, optimizer, seed=0, policy=policy)
        self.params = sum(x.size for x in jax.tree.leaves(self.state.params))
        spec = {"tokens": jax.ShapeDtypeStruct((self.k, s["batch"], s["seq_len"] + 1),
                                               jnp.int32)}
        fn = jax.jit(make_multi_step(make_train_step(model, optimizer, policy=policy)),
                     donate_argnums=0)
        start = time.perf_counter()
        self.fn = fn.lower(self.state, spec).compile(compiler_options=compiler_options)
        self.tokens = jax.random.randint(jax.random.key(2), spec["tokens"].shape, 0, s["vocab"],
                                         jnp.int32)
        self.run()  # first call: allocation settles
        self.compile_s = time.perf_counter() - start

    def run(self) -> float:
        self.state, metrics = self.fn(self.state, {"tokens": self.tokens})
        return float(np.asarray(metrics["loss"])[-1])


class TorchSide:
    """The same model in PyTorch, nanoGPT style (``torch_gpt.py``), K steps per call."""

    framework = "pytorch"

    def __init__(self, s: dict[str, int], eager: bool):
        import torch
        from torch_gpt import Shape, TorchTrainer

        self.torch, self.k = torch, s["k"]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        how = "eager" if eager else "torch.compile"
        self.name = f"PyTorch {torch.__version__} ({how}, bf16 autocast, fused AdamW)"
        torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's setting (bf16 GEMMs anyway)
        gpt = Shape(vocab=s["vocab"], d_model=s["d_model"], layers=s["layers"],
                    heads=s["heads"], seq_len=s["seq_len"])
        start = time.perf_counter()
        self.trainer = TorchTrainer(gpt, device, lr=OPTIM.lr, b1=OPTIM.b1, b2=OPTIM.b2,
                                    weight_decay=OPTIM.weight_decay, compile=not eager)
        self.params = self.trainer.params
        self.tokens = torch.randint(0, s["vocab"], (self.k, s["batch"], s["seq_len"] + 1),
                                    device=device)
        self.run()  # compiles
        self.compile_s = time.perf_counter() - start

    def run(self) -> float:
        return self.trainer.run(self.tokens)


# ---- bench: interleaved timing, profile, HLO -----------------------------------------------------


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

    sides: list[Any] = []
    notes: list[str] = []

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

    base = add(lambda: TrainrunSide("trainrun (GPU defaults: deterministic)", s), "trainrun")
    if base is None:
        return 1
    if add(lambda: TorchSide(s, args.torch_eager), "PyTorch") is None and not args.torch_eager:
        add(lambda: TorchSide(s, True), "PyTorch eager")
    times: dict[str, list[float]] = collections.defaultdict(list)
    losses: dict[str, float] = {}

    def rounds(count: int) -> None:
        for _ in range(count):
            for side in sides:
                start = time.perf_counter()
                losses[side.name] = side.run()
                times[side.name].append((time.perf_counter() - start) / side.k)

    rounds(2)
    report(s, base, sides, times, losses, notes, {}, out, "first two rounds; the final table "
           "follows if the time budget allows")
    profile = profile_step(base, Path(args.trace_dir or out / "trace"))
    optional = [
        ("trainrun, XLA deterministic mode off (autotuned, Triton GEMMs)",
         lambda: TrainrunSide("trainrun, deterministic mode off", s, DETERMINISM_OFF)),
        ("trainrun, scan_layers", lambda: TrainrunSide("trainrun, scan_layers", s,
                                                       scan_layers=True)),
        ("trainrun, remat dots_saveable",
         lambda: TrainrunSide("trainrun, remat dots_saveable", s, remat="dots_saveable")),
    ]
    for name, make in optional:
        if deadline - time.monotonic() < 1.5 * base.compile_s + 10:
            notes.append(f"{name}: skipped (time budget)")
            say(notes[-1])
            continue
        add(make, name)
    round_s = sum(statistics.median(times[x.name]) * x.k if times[x.name] else 10.0
                  for x in sides)
    done = min(len(v) for v in times.values())
    while done < args.rounds and (done < 3 or deadline - time.monotonic() > round_s):
        rounds(1)
        done += 1
    report(s, base, sides, times, losses, notes, profile, out, "final")
    return 0


def report(s: dict[str, int], base: TrainrunSide, sides: list[Any],
           times: dict[str, list[float]], losses: dict[str, float], notes: list[str],
           profile: dict[str, Any], out: Path, when: str) -> None:
    """Part 2's table (and bench.json) from the rounds so far."""
    results = []
    flops = model_flops_per_step(base.params, s)  # one count for every contender
    for side in sides:
        t = times[side.name]
        step_s = statistics.median(t) if t else float("nan")
        results.append({"name": side.name, "framework": side.framework, "params": side.params,
                        "compile_s": side.compile_s, "step_s": step_s, "rounds": len(t),
                        "step_s_all": t, "tokens_per_s": s["batch"] * s["seq_len"] / step_s,
                        "mfu": flops / step_s / PEAK_BF16, "last_loss": losses.get(side.name)})
    torch_s = next((r["step_s"] for r in results if r["framework"] == "pytorch"), None)
    say(f"\n## Part 2: trainrun's step vs PyTorch (nanoGPT style), {s['batch']} x "
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
    say(f"\nFLOPs per step (both sides): {flops / 1e12:.2f} T = 6 x {base.params:,} params x "
        f"tokens + attention; ln(vocab) = {math.log(s['vocab']):.2f} (random tokens: the loss "
        "stays near it)")
    for note in notes:
        say(f"- {note}")
    (out / "bench.json").write_text(json.dumps({"shape": s, "results": results, "notes": notes,
                                                "profile": profile, "when": when}, indent=1))


def profile_step(side: TrainrunSide, trace_dir: Path) -> dict[str, Any]:
    """Part 3: a trace of one call (K steps) of ``side``, per kernel, and its HLO."""
    import gpu_kernels

    result: dict[str, Any] = {}
    say(f"\n## Part 3: where trainrun's step goes (jax.profiler trace of {side.k} steps)\n")
    try:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            side.run()
        kernels = gpu_kernels.read_trace(str(trace_dir))
        say(gpu_kernels.table(kernels, side.k, top=25))
        result["kernels"] = kernel_verdict(kernels, side.k)
    except Exception as err:  # the trace is a report, not a requirement
        say(f"no kernel table ({type(err).__name__}: {str(err)[:300]})")
    hlo = hlo_verdict(side.fn.as_text())
    result["hlo"] = hlo
    say("\n| check | result |\n|---|---|")
    for key, value in {**result.get("kernels", {}), **hlo}.items():
        say(f"| {key} | {value} |")
    return result


GEMM_WORDS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")
ATTENTION_WORDS = ("sdpa", "flash", "fmha", "attention")


def kernel_verdict(kernels, steps: int) -> dict[str, str]:
    gemm, attention = collections.Counter(), collections.Counter()
    for name, us in kernels.total_us.items():
        low = name.lower()
        if any(w in low for w in ATTENTION_WORDS):
            attention[name] += us
        elif any(w in low for w in GEMM_WORDS):
            gemm[name] += us
    total = sum(kernels.total_us.values()) or 1.0
    # a heuristic on cuBLAS/CUTLASS naming; the HLO's operand dtypes below are the record
    half = [n for n in gemm if re.search(r"bf16|f16|_h_|hsh|_hh", n.lower())]
    single = [n for n in gemm if re.search(r"f32f32|tf32|sgemm|s1688|_s_|sss", n.lower())]
    return {
        "GEMM kernels: device ms/step (share)":
            f"{sum(gemm.values()) / steps / 1e3:.1f} ({sum(gemm.values()) / total:.0%}), "
            f"{len(gemm)} names",
        "GEMM kernel names that say half precision": f"{len(half)} of {len(gemm)}",
        "GEMM kernel names that say float32/TF32":
            f"{len(single)}" + (f": {', '.join(n[:60] for n in single[:3])}" if single else ""),
        "attention kernels (cuDNN sdpa/flash)":
            f"{sum(attention.values()) / steps / 1e3:.1f} ms/step, "
            + (", ".join(n[:70] for n in list(attention)[:2]) or "none: flash attention NOT "
               "engaged"),
    }


def hlo_verdict(text: str) -> dict[str, str]:
    """Custom calls of the compiled step by target and operand dtypes; Triton GEMM fusions;
    scatters left in the program."""
    calls = collections.Counter()
    for line in text.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if not target:
            continue
        operands = re.search(r"custom-call\((.*?)\), custom_call_target", line)
        dtypes = re.findall(r"\b([a-z]+[0-9]*[a-z0-9]*)\[", operands.group(1)) if operands else []
        calls[f"{target.group(1)}({'x'.join(dtypes[:2])})"] += 1
    gemms = {k: v for k, v in calls.items() if "cublas" in k}
    cudnn = {k: v for k, v in calls.items() if "cudnn" in k}
    return {
        "HLO: cuBLAS GEMM custom calls (operand dtypes)":
            ", ".join(f"{k}: {v}" for k, v in sorted(gemms.items())) or "none",
        "HLO: cuDNN custom calls (flash attention: fmha)":
            ", ".join(f"{k}: {v}" for k, v in sorted(cudnn.items())) or "none",
        "HLO: Triton GEMM fusions": str(text.count('"kind":"__triton_gemm"')),
        "HLO: scatter ops left (atomic on GPU)": str(len(re.findall(r"\bscatter\(", text))),
        "HLO: sort ops (deterministic scatter)": str(len(re.findall(r"\bsort\(", text))),
    }


# ---- scatter: the embedding gradient -------------------------------------------------------------


def scatter(args: argparse.Namespace) -> int:
    s = shape(args.tiny)
    vocab, d, n = s["vocab"], s["d_model"], s["batch"] * s["seq_len"]
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, d), np.float32)
    # half the ids uniform, half from 64 ids: many repeats, as frequent tokens have
    tokens = rng.permutation(np.concatenate([rng.integers(0, vocab, n // 2),
                                             rng.integers(0, 64, n - n // 2)])).astype(np.int32)
    rows = rng.standard_normal((n, d), np.float32)
    reference = np.zeros((vocab, d), np.float64)
    np.add.at(reference, tokens, rows.astype(np.float64))

    def grad(t, tok, w):
        return jax.grad(lambda t: jnp.sum(jnp.take(t, tok, axis=0) * w))(t)

    say(f"\n## Part 5b: the embedding gradient ({n:,} rows into a {vocab:,} x {d} table, "
        "repeated ids)\n")
    say("| XLA GPU mode | max abs error vs float64 | two calls bitwise equal | ms per call | "
        "scatter / sort / while ops in HLO |")
    say("|---|---:|:---:|---:|---|")
    args_dev = [jnp.asarray(x) for x in (table, tokens, rows)]
    results, ok = {}, True
    modes = (("trainrun defaults", None), ("deterministic mode off", DETERMINISM_OFF))
    for label, options in modes:
        try:
            fn = jax.jit(grad).lower(*args_dev).compile(compiler_options=options)
        except Exception as err:
            say(f"| {label} | not compiled: {type(err).__name__}: {str(err)[:200]} | | | |")
            ok = ok and options is not None
            continue
        first, second = np.asarray(fn(*args_dev)), np.asarray(fn(*args_dev))
        start = time.perf_counter()
        for _ in range(10):
            out = fn(*args_dev)
        out.block_until_ready()
        ms = (time.perf_counter() - start) / 10 * 1e3
        text = fn.as_text()
        ops = "/".join(str(len(re.findall(rf"\b{op}\(", text))) for op in ("scatter", "sort",
                                                                             "while"))
        error = float(np.max(np.abs(first - reference)))
        equal = first.tobytes() == second.tobytes()
        results[label] = {"max_abs_error": error, "bitwise_repeat": equal, "ms": ms, "ops": ops}
        say(f"| {label} | {error:.2e} | {'yes' if equal else 'NO'} | {ms:.2f} | {ops} |")
        if options is None:
            ok = ok and equal and error < 1e-3
    say(f"\nembedding gradient under trainrun's defaults: {'PASS' if ok else 'FAIL'} "
        "(error < 1e-3 and bitwise repeatable)")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scatter.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


# ---- helpers for the shell script ----------------------------------------------------------------


def tokens(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, args.count, dtype=np.int64).astype(np.uint16)
    Path(args.path).parent.mkdir(parents=True, exist_ok=True)
    ids.tofile(args.path)
    say(f"wrote {args.count:,} random uint16 token ids (< {args.vocab}) to {args.path}")
    return 0


def same(args: argparse.Namespace) -> int:
    """Two runs' metrics.jsonl: every train step's loss and grad norm bitwise equal?"""
    runs = [{r["step"]: r for r in read_metrics(Path(d) / "metrics.jsonl")} for d in args.runs]
    steps = sorted(set(runs[0]) & set(runs[1]))
    if not steps or set(runs[0]) != set(runs[1]):
        say(f"FAIL: steps differ or are missing ({len(runs[0])} vs {len(runs[1])} records)")
        return 1
    for step in steps:
        for name in ("loss", "grad_norm"):
            a, b = runs[0][step].get(name), runs[1][step].get(name)
            if np.float32(a).tobytes() != np.float32(b).tobytes() or (a is None) != (b is None):
                say(f"FAIL: first difference at step {step}: {name} {a!r} vs {b!r}")
                return 1
    say(f"PASS: {len(steps)} steps, loss and grad_norm bitwise equal (last loss "
        f"{runs[0][steps[-1]]['loss']:.6f})")
    return 0


def percent(value: float | None) -> str:
    return f"{value:.1%}" if isinstance(value, float | int) else "n/a"


def loop(args: argparse.Namespace) -> int:
    """Part 4's table: the CLI run's summary next to the bare step's time from ``bench``."""
    summary = json.loads((Path(args.run_dir) / "summary.json").read_text())
    bare = None
    if Path(args.bench_json).is_file():
        bench_results = json.loads(Path(args.bench_json).read_text())["results"]
        bare = next((r["step_s"] for r in bench_results if r["framework"] == "trainrun"), None)
    step_s = summary["step_time_median_s"]
    say("| measure | value |\n|---|---:|")
    rows = {
        "loop step time, median (ms)": f"{step_s * 1e3:.1f}" if step_s else "n/a",
        "bare step in bench (ms)": f"{bare * 1e3:.1f}" if bare else "n/a",
        "loop / bare": f"{step_s / bare:.3f}" if step_s and bare else "n/a",
        "examples/s": f"{summary.get('examples_per_s') or 0:,.1f}",
        "compile (s)": f"{summary.get('compile_s', 0):.1f}",
        "wall (s)": f"{summary.get('wall_s', 0):.1f}",
        "goodput": percent(summary.get("goodput")),
        "MFU (trainrun's own peak and count)": percent(summary.get("mfu")),
        "final loss": f"{summary.get('final_loss') or float('nan'):.4f}",
    }
    for key, value in rows.items():
        say(f"| {key} | {value} |")
    split = summary.get("wall_time_split_s", {})
    say("\nwall-time split (s): " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("bench")
    b.add_argument("--tiny", action="store_true")
    b.add_argument("--budget-s", type=float, default=140.0)
    b.add_argument("--rounds", type=int, default=7)
    b.add_argument("--k", type=int, default=0, help="steps per call (default: 10, tiny 2)")
    b.add_argument("--torch-eager", action="store_true")
    b.add_argument("--out", default=tempfile.mkdtemp(prefix="gpu-lm-"))
    b.add_argument("--trace-dir", default=None, help="default: OUT/trace")
    b.set_defaults(handler=bench)
    sc = commands.add_parser("scatter")
    sc.add_argument("--tiny", action="store_true")
    sc.add_argument("--out", default=None)
    sc.set_defaults(handler=scatter)
    t = commands.add_parser("tokens")
    t.add_argument("path")
    t.add_argument("count", type=int)
    t.add_argument("vocab", type=int)
    t.set_defaults(handler=tokens)
    sa = commands.add_parser("same")
    sa.add_argument("runs", nargs=2)
    sa.set_defaults(handler=same)
    lo = commands.add_parser("loop")
    lo.add_argument("run_dir")
    lo.add_argument("bench_json")
    lo.set_defaults(handler=loop)
    args = parser.parse_args()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
