"""``benchmarks/overhead.py`` on this checkout and on an earlier revision, interleaved: the same
table's rows side by side, to show a change kept the loop's cost.

    python benchmarks/overhead_against.py REV [--rounds 5] [--steps 2000] [--byte-lm STEPS]

Each round runs the earlier revision's ``overhead.py`` (its own source, on ``PYTHONPATH``, from
a ``git worktree`` made in a temporary folder) and then this checkout's, one repeat each, in
fresh processes; the best and the median over rounds are reported per row and checkout.
``--byte-lm STEPS`` adds a row per round: the built-in byte LM trained ``STEPS`` steps by each
checkout's ``trainrun train``, its median step time from the run's ``summary.json``;
``--steps 0`` leaves out ``overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (?P<name>[^|]+?) \| (?P<best>[0-9.]+) \| [0-9.]+ \|")


def one_round(tree: Path, steps: int) -> dict[str, float]:
    """µs a step of each row of ``tree``'s overhead table, one repeat."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / "overhead.py"),
                          "--repeats", "1", "--steps", str(steps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows[match["name"]] = float(match["best"])
    return rows


def byte_lm_round(tree: Path, steps: int) -> dict[str, float]:
    """µs a step of the byte LM (``--config lm``) trained by ``tree``'s ``trainrun``: the
    median step time its summary reports, compile and checkpoints left out."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run([sys.executable, "-m", "trainrun", "train", "--config", "lm",
                        "--run-dir", run_dir, f"steps={steps}"], env=env, check=True,
                       capture_output=True, text=True)
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return {f"byte LM, {steps} steps (step time median)":
            1e6 * summary["step_time_median_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rev")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--byte-lm", type=int, default=0, metavar="STEPS")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before),
                        args.rev], check=True, capture_output=True)
        try:
            results: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for _ in range(args.rounds):
                for label, tree in (("before", before), ("after", REPO)):
                    rows = one_round(tree, args.steps) if args.steps else {}
                    if args.byte_lm:
                        rows |= byte_lm_round(tree, args.byte_lm)
                    for name, value in rows.items():
                        results[label].setdefault(name, []).append(value)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(before)], check=True)
    print(f"overhead.py, {args.steps} steps, {args.rounds} interleaved rounds; before = "
          f"{args.rev}, after = this checkout")
    print("| row | before µs/step, best / median | after µs/step, best / median | "
          "after / before (best) |\n|---|---:|---:|---:|")
    for name, after in results["after"].items():
        old = results["before"].get(name)
        if old is None:
            print(f"| {name} | | {min(after):.1f} / {statistics.median(after):.1f} | |")
            continue
        print(f"| {name} | {min(old):.1f} / {statistics.median(old):.1f} | {min(after):.1f} / "
              f"{statistics.median(after):.1f} | {min(after) / min(old):.2f} |")


if __name__ == "__main__":
    main()
