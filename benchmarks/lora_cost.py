"""LoRA against full fine-tuning of the same transformer: compile time, eval time and step time
of whole runs, side by side in one process.

    python benchmarks/lora_cost.py [--models tiny,wide] [--rounds 3]

Each round runs every contender once (``trainrun.run`` into a fresh directory, interleaved:
full, LoRA, full, LoRA, ...) and reads its summary: ``compile`` and ``eval`` from the wall-time
split (eval is the one evaluation at the last step, its program's compile included), step time
the median over the run's timed windows (the first window is warmup; calls end with
``block_until_ready`` as the loop reads them). Best and median over ``--rounds`` rounds; XLA's
persistent compilation cache is off so every run compiles from scratch. LoRA: rank 8 on q and
v, only the adapters train (the default with ``model.lora``).

Models: ``tiny`` is GPT-2's layout at 2 layers x 64 wide (a tiny random GPT-2); ``wide`` is 2
layers x 512, where the rank-8 adapters are about 1% of the targeted kernels.
"""

from __future__ import annotations

import argparse
import email
import io
import statistics
import subprocess
import tempfile
from pathlib import Path

import jax

import trainrun
from trainrun.config import load_config
from trainrun.platform.process import configure_process
from trainrun.training.loop import run

LORA = "model.lora={rank: 8, targets: [q, v]}"
GPT2 = ["model.positions=learned", "model.bias=true", "model.layers=2"]
MODELS = {
    "tiny": [*GPT2, "model.d_model=64", "model.heads=2", "model.seq_len=128",
             "data.seq_len=128", "data.batch_size=16", "steps=60", "steps_per_call=10",
             "log_every=10"],
    "wide": [*GPT2, "model.d_model=512", "model.heads=8", "model.seq_len=64",
             "data.seq_len=64", "data.batch_size=8", "eval.batch_size=8", "steps=30",
             "steps_per_call=5", "log_every=5"],
}


def one_run(overrides: list[str], corpus: list[str], run_dir: Path) -> dict[str, float]:
    """Compile, eval and median step time (s) of one run of the byte LM with ``overrides``."""
    config = load_config("lm", [*overrides, f"data.paths={corpus}", "checkpoint.every=0",
                                "optimizer.schedule.warmup_steps=2",
                                "data.eval_fraction=0.1"])
    config = config.model_copy(update={"eval": config.eval.model_copy(
        update={"every": config.steps})})
    summary = run(config, run_dir, fresh=True, out=io.StringIO())
    assert summary.step_time_median_s is not None
    return {"compile": summary.compile_s, "eval": summary.wall_time_split_s["eval"],
            "step": summary.step_time_median_s}


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    # A fixed corpus the size of a small fine-tuning set, the same for every revision measured.
    corpus = sorted(str(p) for p in Path(email.__file__).parent.rglob("*.py"))
    source = Path(trainrun.__file__).parent
    revision = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, trainrun from {source} "
          f"({revision}); {args.rounds} rounds, interleaved\n")
    print("| model | contender | compile s best / median | eval s best / median "
          "| step ms best / median |")
    print("|---|---|---:|---:|---:|")
    ratios = []
    for name in args.models.split(","):
        times: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                for contender, extra in (("full", []), ("lora", [LORA])):
                    times[contender].append(one_run([*MODELS[name], *extra], corpus,
                                                    Path(tmp) / contender))
        med = {c: {k: statistics.median(r[k] for r in rows) for k in ("compile", "eval", "step")}
               for c, rows in times.items()}
        for contender, rows in times.items():
            cells = [f"{min(r[k] for r in rows) * scale:.2f} / {med[contender][k] * scale:.2f}"
                     for k, scale in (("compile", 1), ("eval", 1), ("step", 1e3))]
            print(f"| {name} | {contender} | {' | '.join(cells)} |", flush=True)
        ratios.append((name, {k: med["lora"][k] / med["full"][k]
                              for k in ("compile", "eval", "step")}))
    print("\nLoRA / full (medians)")
    print("| model | compile | eval | step |")
    print("|---|---:|---:|---:|")
    for name, r in ratios:
        print(f"| {name} | {r['compile']:.2f}x | {r['eval']:.2f}x | {r['step']:.2f}x |")


if __name__ == "__main__":
    main()
