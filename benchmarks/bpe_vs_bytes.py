"""The BPE LM (configs/lm_bpe.yaml) against the byte LM (configs/lm.yaml) in the same wall time:
held-out bits per byte on the same held-out bytes.

Both runs start at once, as two processes on the same machine, so they share its load; each
evaluates the whole held-out split once, at its last step. The BPE run's step count is chosen
so that its training takes no longer than the byte run's 600 steps (``--bpe-steps``; a BPE step
costs more: its output head is 16 times wider). The tokenizer is trained and the corpus encoded
before either starts, so neither run's time includes it.

    .venv/bin/python benchmarks/bpe_vs_bytes.py --bpe-steps 340

Prints each run's steps, training wall time (wall time less eval), and held-out bits per byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def prepare(work: Path) -> None:
    """Train the tokenizer and encode the corpus (cached beside the tokenizer)."""
    code = ("from trainrun.config import load_config; from trainrun.data import build_dataset; "
            "build_dataset(load_config('lm_bpe').data, seed=0)")
    subprocess.run([sys.executable, "-c", code], cwd=work, check=True)


def train(work: Path, config: str, steps: int) -> float:
    """Run ``config`` for ``steps``; the load average (1 minute) over the run."""
    with open(work / f"{config}.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainrun", "train", "--config", config, "--run-dir",
             str(work / config), "--fresh", f"steps={steps}", f"eval.every={steps}",
             "eval.batches=0", "checkpoint.every_seconds=0", "metrics.tensorboard=false"],
            cwd=work, stdout=log, stderr=subprocess.STDOUT)
        loads = []
        while process.poll() is None:
            loads.append(os.getloadavg()[0])
            time.sleep(5)
    if process.returncode:
        sys.exit(f"{config} failed; see {work / config}.log")
    return sum(loads) / max(len(loads), 1)


def result(work: Path, config: str) -> dict:
    summary = json.loads((work / config / "summary.json").read_text())
    lines = (work / config / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    final = [row for row in rows if row.get("split") == "eval"][-1]
    split = summary["wall_time_split_s"]
    return {"steps": summary["steps_done"], "train_s": summary["wall_s"] - split["eval"],
            "step_ms": summary["step_time_median_s"] * 1e3,
            "bits_per_byte": final["bits_per_byte"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bpe-steps", type=int, default=290)
    parser.add_argument("--work", default="bench-bpe")
    args = parser.parse_args()
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    prepare(work)
    loads = {"lm": train(work, "lm", 600), "lm_bpe": train(work, "lm_bpe", args.bpe_steps)}
    print("| run | steps | training wall time (s) | step (ms) | load average | "
          "held-out bits per byte |")
    print("|---|---:|---:|---:|---:|---:|")
    for config, load in loads.items():
        r = result(work, config)
        print(f"| {config} | {r['steps']} | {r['train_s']:.1f} | {r['step_ms']:.0f} | "
              f"{load:.1f} | {r['bits_per_byte']:.4f} |")


if __name__ == "__main__":
    main()
