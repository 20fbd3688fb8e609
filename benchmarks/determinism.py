"""What bitwise resume needs on XLA:CPU, measured: ``trainrun verify-resume`` repeated under
default threading and with XLA's CPU threading pinned, and what pinning costs in throughput.

    python benchmarks/determinism.py [--repeats 5] [--throughput-steps 300]

Workloads: the default MLP, and the byte-level transformer LM (multi-threaded matmuls,
attention, an embedding gradient that is a scatter-add) with dropout on shuffled data read
through Grain's prefetching iterator. Each
verify-resume runs three processes side by side (uninterrupted, killed after a committed
checkpoint, killed during an async save) on a machine shared with other jobs, so thread
scheduling differs from run to run. XLA flags are fixed when a process starts, so each setting
runs in its own processes (not side by side in one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {
    "default threading": "",
    "pinned (eigen single-threaded, 1 intra-op thread)":
        "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
WORKLOADS = {
    "mlp": ["--config", "mlp", "steps=60", "checkpoint.every=20", "metrics.tensorboard=false"],
    "lm + dropout": ["--config", "lm", "steps=40", "steps_per_call=5", "checkpoint.every=10",
                     "optimizer.schedule.warmup_steps=10",
                     "eval.every=0", "model.dropout=0.1", "metrics.tensorboard=false"],
}


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


def steps_per_s(workload: list[str], flags: str, steps: int, root: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    args = [a for a in workload if not a.startswith("steps=")] + [f"steps={steps}",
                                                                   "checkpoint.every=0"]
    subprocess.run([sys.executable, "-m", "trainrun", "train", "--run-dir", str(run_dir), *args],
                   capture_output=True, text=True, env=env_with(flags), check=True)
    return json.loads((run_dir / "summary.json").read_text())["steps_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--throughput-steps", type=int, default=300)
    args = parser.parse_args()

    passes = {(w, s): 0 for w in WORKLOADS for s in SETTINGS}
    speed: dict[tuple[str, str], list[float]] = {(w, s): [] for w in WORKLOADS for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # settings interleaved, so load affects both alike
            for w, workload in WORKLOADS.items():
                for s, flags in SETTINGS.items():
                    passes[w, s] += verify(workload, flags)
        for _ in range(2):
            for w, workload in WORKLOADS.items():
                for s, flags in SETTINGS.items():
                    speed[w, s].append(steps_per_s(workload, flags, args.throughput_steps,
                                                   Path(tmp)))

    print(f"verify-resume repeated {args.repeats} times per cell; throughput: best of 2 runs "
          f"of {args.throughput_steps} steps (steady-state steps/s from summary.json)\n")
    print("| workload | XLA CPU threading | verify-resume passes | steps/s | vs default |")
    print("|---|---|---:|---:|---:|")
    for w in WORKLOADS:
        base = max(speed[w, "default threading"])
        for s in SETTINGS:
            best = max(speed[w, s])
            print(f"| {w} | {s} | {passes[w, s]}/{args.repeats} | {best:,.1f} | "
                  f"{best / base:.2f}x |")


if __name__ == "__main__":
    main()
