"""What bitwise resume needs on XLA:CPU, measured: fresh runs of one config in separate
processes (three at a time, next to a process hammering memory bandwidth) compared bit for bit,
``trainrun verify-resume`` repeated, under default threading and with XLA's CPU threading
pinned; and what pinning costs in throughput.

    python benchmarks/determinism.py [--fresh 6] [--repeats 2] [--throughput-steps 200]

Workloads: the default MLP, and the byte-level transformer LM (multi-threaded matmuls,
attention, an embedding gradient that is a scatter-add) with dropout on shuffled data read
through Grain's prefetching iterator. Each
verify-resume runs three processes side by side (uninterrupted, killed after a committed
checkpoint, killed during an async save) on a machine shared with other jobs, so thread
scheduling differs from run to run. XLA flags are fixed when a process starts, so each setting
runs in its own processes (not side by side in one). Processes import trainrun from this
working tree: the script hashes the sources before and after and says if they changed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SETTINGS = {
    "default threading": "",
    "pinned (eigen single-threaded, 1 intra-op thread)":
        "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
WORKLOADS = {
    "mlp": ["--config", "mlp", "steps=60", "checkpoint.every=20", "metrics.tensorboard=false"],
    "lm + dropout": ["--config", "lm", "steps=40", "steps_per_call=5", "checkpoint.every=10",
                     "optimizer.schedule.warmup=10",
                     "eval.every=0", "model.dropout=0.1", "metrics.tensorboard=false"],
}


HOG = "import numpy as np\na = np.ones(50_000_000)\nwhile True:\n    a += 1e-9\n"


def env_with(flags: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    return env


def verify(workload: list[str], flags: str) -> bool:
    done = subprocess.run([sys.executable, "-m", "trainrun", "verify-resume", *workload],
                          capture_output=True, text=True, env=env_with(flags), check=False)
    if done.returncode not in (0, 1):
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    return done.returncode == 0


def fresh_run(workload: list[str], flags: str, root: Path) -> str:
    """sha256 of the per-step losses of one uninterrupted run."""
    run_dir = Path(tempfile.mkdtemp(dir=root))
    subprocess.run([sys.executable, "-m", "trainrun", "train", "--run-dir", str(run_dir),
                    *workload], capture_output=True, text=True, env=env_with(flags), check=True)
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]
    return hashlib.sha256(json.dumps(losses).encode()).hexdigest()


def sources_digest() -> str:
    src = Path(__file__).resolve().parents[1] / "src" / "trainrun"
    digest = hashlib.sha256()
    for path in sorted(src.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def steps_per_s(workload: list[str], flags: str, steps: int, root: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    args = [a for a in workload if not a.startswith("steps=")] + [f"steps={steps}",
                                                                   "checkpoint.every=0"]
    subprocess.run([sys.executable, "-m", "trainrun", "train", "--run-dir", str(run_dir), *args],
                   capture_output=True, text=True, env=env_with(flags), check=True)
    return json.loads((run_dir / "summary.json").read_text())["steps_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fresh", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--throughput-steps", type=int, default=200)
    args = parser.parse_args()

    before = sources_digest()
    cells = [(w, s) for w in WORKLOADS for s in SETTINGS]
    passes = {cell: 0 for cell in cells}
    sequences: dict[tuple[str, str], list[str]] = {cell: [] for cell in cells}
    speed: dict[tuple[str, str], list[float]] = {cell: [] for cell in cells}
    with tempfile.TemporaryDirectory() as tmp:
        hog = subprocess.Popen([sys.executable, "-c", HOG])
        try:
            jobs = [cell for _ in range(args.fresh) for cell in cells]
            with ThreadPoolExecutor(3) as pool:
                hashes = pool.map(lambda c: fresh_run(WORKLOADS[c[0]], SETTINGS[c[1]],
                                                      Path(tmp)), jobs)
                for cell, digest in zip(jobs, hashes, strict=True):
                    sequences[cell].append(digest)
        finally:
            hog.kill()
        for _ in range(args.repeats):  # settings interleaved, so load affects both alike
            for w, workload in WORKLOADS.items():
                for s, flags in SETTINGS.items():
                    passes[w, s] += verify(workload, flags)
        for _ in range(2):
            for w, workload in WORKLOADS.items():
                for s, flags in SETTINGS.items():
                    speed[w, s].append(steps_per_s(workload, flags, args.throughput_steps,
                                                   Path(tmp)))

    print(f"{args.fresh} fresh runs per cell, 3 processes at a time beside a memory-bandwidth "
          f"hog; verify-resume {args.repeats} times per cell; throughput: best of 2 runs of "
          f"{args.throughput_steps} steps (steady-state steps/s from summary.json)\n")
    print("| workload | XLA CPU threading | distinct loss sequences | verify-resume passes | "
          "steps/s | vs default |")
    print("|---|---|---:|---:|---:|---:|")
    for w in WORKLOADS:
        base = max(speed[w, "default threading"])
        for s in SETTINGS:
            best = max(speed[w, s])
            distinct = len(set(sequences[w, s]))
            print(f"| {w} | {s} | {distinct} of {len(sequences[w, s])} runs | "
                  f"{passes[w, s]}/{args.repeats} | {best:,.1f} | {best / base:.2f}x |")
    if sources_digest() != before:
        print("\nWARNING: trainrun's sources changed during the measurement; processes may "
              "have run different code")


if __name__ == "__main__":
    main()
