"""LoRA against full fine-tuning of the same transformer: compile time, eval time and step time
of whole runs, side by side in one process.

    python benchmarks/lora_cost.py [--models tiny,wide,llama] [--rounds 3]
    python benchmarks/lora_cost.py --step-program [--rounds 30]

Each round runs every contender once (``trainrun.run`` into a fresh directory, interleaved:
full, LoRA, full, LoRA, ...) and reads its summary: ``compile`` and ``eval`` from the wall-time
split (eval is the one evaluation at the last step, its program's compile included), step time
the median over the run's timed windows (the first window is warmup; calls end with
``block_until_ready`` as the loop reads them), init the time from the config to the state on
its devices. Best and median over ``--rounds`` rounds; XLA's persistent compilation cache is
off so every run compiles from scratch. LoRA: rank 8 on q and v, or on every linear layer of
the blocks (``all-linear``); only the adapters train (the default with ``model.lora``).

Models: ``tiny`` is GPT-2's layout at 2 layers x 64 wide (a tiny random GPT-2); ``wide`` is 2
layers x 512, where the rank-8 adapters are about 1% of the targeted kernels; ``llama`` is the
Llama layout of the fine-tuning guide's tiny Llama (2 layers x 64, 4 query heads sharing 2
key/value heads, SwiGLU 128, RMSNorm, rotary positions, an untied head), trained from random
init; ``llama-dir`` is the same model written as a Hugging Face directory and fine-tuned from
it with the built-in ``finetune`` config, as the guide does (the base params are read, the
adapters drawn fresh).

``--step-program``: on the ``llama`` layout, the compiled K-step program alone (K=10, one batch
on the device, no loop around it), full against LoRA all-linear and against LoRA all-linear
with each adapter's A applied by its own matmul (``transformer._project_each`` as before the
adapters that read one input shared theirs), in one process, interleaved, 5 calls a round:
the step's own cost, without a whole run's noise.
"""

from __future__ import annotations

import argparse
import email
import io
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax

import trainrun
from trainrun.config import load_config
from trainrun.platform.process import configure_process
from trainrun.training.loop import run

CONTENDERS = {"full": [], "lora q,v": ["model.lora={rank: 8, targets: [q, v]}"],
              "lora all-linear": ["model.lora={rank: 8, targets: all-linear}"]}
GPT2 = ["model.positions=learned", "model.bias=true", "model.layers=2"]
LLAMA = ["model.positions=rope", "model.mlp=swiglu", "model.norm=rmsnorm",
         "model.tie_embeddings=false", "model.layers=2", "model.d_model=64", "model.heads=4",
         "model.kv_heads=2", "model.mlp_hidden=128"]
MODELS = {
    "tiny": [*GPT2, "model.d_model=64", "model.heads=2", "model.seq_len=128",
             "data.seq_len=128", "data.batch_size=16", "steps=60", "steps_per_call=10",
             "metrics.every=10"],
    "wide": [*GPT2, "model.d_model=512", "model.heads=8", "model.seq_len=64",
             "data.seq_len=64", "data.batch_size=8", "eval.batch_size=8", "steps=30",
             "steps_per_call=5", "metrics.every=5"],
    "llama": [*LLAMA, "model.seq_len=64", "data.seq_len=64", "data.batch_size=16", "steps=60",
              "steps_per_call=10", "metrics.every=10"],
    # the guide's path: the built-in finetune config from a Hugging Face directory
    "llama-dir": ["data.seq_len=64", "data.batch_size=16", "steps=60", "steps_per_call=10",
                  "metrics.every=10"],
}


def llama_dir(path: Path) -> Path:
    """A random Llama of the ``llama`` layout (vocabulary of the 256 bytes) as a Hugging Face
    directory, written by trainrun's own writer."""
    from trainrun.config import TransformerModel
    from trainrun.models import build_model
    from trainrun.models.huggingface import write_model_dir

    cfg = TransformerModel(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, mlp="swiglu",
                           mlp_hidden=128, norm="rmsnorm", tie_embeddings=False, seq_len=256)
    params = jax.device_get(build_model(cfg).init(jax.random.key(0)))
    return write_model_dir(params, cfg, path, model_type="llama")


def one_run(overrides: list[str], corpus: list[str], run_dir: Path) -> dict[str, float]:
    """Compile, eval and median step time (s) of one run of the byte LM with ``overrides``."""
    base = "finetune" if any(o.startswith("init.from=") for o in overrides) else "lm"
    config = load_config(base, [*overrides, f"data.paths={corpus}", "checkpoint.every=0",
                                "optimizer.schedule.warmup=2",
                                "data.eval_fraction=0.1"])
    config = config.model_copy(update={"eval": config.eval.model_copy(
        update={"every": config.steps})})
    summary = run(config, run_dir, fresh=True, out=io.StringIO())
    assert summary.step_time_median_s is not None
    return {"init": summary.wall_time_split_s["init"], "compile": summary.compile_s,
            "eval": summary.wall_time_split_s["eval"], "step": summary.step_time_median_s}


def step_program(overrides: list[str], apart: bool = False) -> Callable[[], float]:
    """A function timing 5 calls of the compiled 10-step program of the ``llama`` layout with
    ``overrides``: ms a step. apart: each adapter's A by its own matmul."""
    import numpy as np

    from trainrun.fast.strategies import Strategies
    from trainrun.models import build_model, transformer
    from trainrun.program.compiled import CompiledSteps
    from trainrun.program.optim import build_optimizer
    from trainrun.program.state import abstract_state, init_state
    from trainrun.reporting.timing import Stopwatch

    k = 10
    config = load_config("lm", [*MODELS["llama"], "model.vocab=256", *overrides])
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 600)
    together = transformer._project_each
    if apart:
        transformer._project_each = lambda pairs, x: [transformer._project(layer, adapter, x)
                                                      for layer, adapter in pairs]
    try:  # traced and compiled here: the patch is in the program
        abstract, chosen = abstract_state(model, optimizer, 0), Strategies()
        programs = CompiledSteps(model, optimizer, k, Stopwatch(), abstract=abstract,
                                 carrier=chosen.state_carrier(abstract),
                                 keep=chosen.nonfinite_guard(k))
        carried = [programs.carry(init_state(model, optimizer, 0))]
        tokens = np.random.default_rng(0).integers(0, 256, (k, 16, 65)).astype(np.int32)
        batch = jax.device_put({"tokens": tokens})
        carried[0], packed = programs(k, carried[0], batch)
        packed.block_until_ready()
    finally:
        transformer._project_each = together

    def measure() -> float:
        start = time.perf_counter()
        for _ in range(5):
            carried[0], rows = programs(k, carried[0], batch)
        rows.block_until_ready()
        return (time.perf_counter() - start) / (5 * k) * 1e3

    return measure


def step_programs(rounds: int) -> None:
    lora = "model.lora={rank: 8, targets: all-linear}"
    contenders = {"full": step_program([]), "LoRA all-linear": step_program([lora]),
                  "LoRA all-linear, each A apart": step_program([lora], apart=True)}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, measure in contenders.items():
            times[name].append(measure())
    full = statistics.median(times["full"])
    print(f"llama layout, the 10-step program alone, {rounds} interleaved rounds of 5 calls")
    print("| contender | step ms best / median | / full (median) |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.2f} / {statistics.median(values):.2f} | "
              f"{statistics.median(values) / full:.2f}x |")


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,wide,llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-program", action="store_true",
                        help="time the compiled step program alone (module docstring)")
    args = parser.parse_args()
    if args.step_program:
        step_programs(args.rounds)
        return
    jax.config.update("jax_enable_compilation_cache", False)
    # A fixed corpus the size of a small fine-tuning set, the same for every revision measured.
    corpus = sorted(str(p) for p in Path(email.__file__).parent.rglob("*.py"))
    source = Path(trainrun.__file__).parent
    revision = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, trainrun from {source} "
          f"({revision}); {args.rounds} rounds, interleaved\n")
    keys = ("init", "compile", "eval", "step")
    print("| model | contender | init s best / median | compile s best / median "
          "| eval s best / median | step ms best / median |")
    print("|---|---|---:|---:|---:|---:|")
    ratios = []
    for name in args.models.split(","):
        times: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
        with tempfile.TemporaryDirectory() as tmp:
            source = ([f"init.from={llama_dir(Path(tmp) / 'llama-tiny')}"]
                      if name == "llama-dir" else [])
            for _ in range(args.rounds):
                for i, (contender, extra) in enumerate(CONTENDERS.items()):
                    times[contender].append(one_run([*MODELS[name], *source, *extra], corpus,
                                                    Path(tmp) / str(i)))
        med = {c: {k: statistics.median(r[k] for r in rows) for k in keys}
               for c, rows in times.items()}
        for contender, rows in times.items():
            cells = [f"{min(r[k] for r in rows) * scale:.2f} / {med[contender][k] * scale:.2f}"
                     for k, scale in zip(keys, (1, 1, 1, 1e3), strict=True)]
            print(f"| {name} | {contender} | {' | '.join(cells)} |", flush=True)
        for contender in CONTENDERS:
            if contender != "full":
                ratios.append((name, contender,
                               {k: med[contender][k] / med["full"][k] for k in keys}))
    print("\nLoRA / full (medians)")
    print("| model | contender | init | compile | eval | step |")
    print("|---|---|---:|---:|---:|---:|")
    for name, contender, r in ratios:
        print(f"| {name} | {contender} | " + " | ".join(f"{r[k]:.2f}x" for k in keys) + " |")


if __name__ == "__main__":
    main()
