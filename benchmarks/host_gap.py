"""How the host's work between calls slows the next call on XLA:CPU: trainrun's step program
(the default MLP, K steps a call, batches cut on the device) called back to back, and with
``--gaps`` microseconds of Python work after each call (a busy loop touching no memory, so no
cache is disturbed by it); per-thread CPU time shows what XLA's pool threads did meanwhile.

    python benchmarks/host_gap.py [--k 10] [--calls 300] [--repeats 3] [--gaps 0 200 1000 5000]

The gaps are interleaved within each repeat; the table gives the median call per step over the
calls of the best repeat, and the extra time per call against back-to-back calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from trainrun.config import load_config
from trainrun.data import build_dataset
from trainrun.data.resident import ResidentBatches
from trainrun.dispatch import CompiledSteps
from trainrun.models import build_model
from trainrun.optim import build_optimizer
from trainrun.process import configure_process
from trainrun.state import abstract_state, init_state
from trainrun.timing import Stopwatch


def busy(microseconds: float) -> None:
    """Python work for ``microseconds`` of wall time (the loop's own bookkeeping stands in)."""
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


def thread_cpu_ticks() -> dict[str, int]:
    """User + system clock ticks of each of this process's threads (Linux ``/proc``)."""
    ticks = {}
    for task in Path("/proc/self/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        ticks[task.name] = int(fields[11]) + int(fields[12])
    return ticks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gaps", type=int, nargs="+", default=[0, 200, 1000, 5000])
    args = parser.parse_args()
    configure_process()  # as `trainrun train` runs: inline CPU calls, the allocator setting
    k = args.k
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 1000)
    resident = ResidentBatches(build_dataset(config.data, seed=config.seed), 0)
    programs = CompiledSteps(model, optimizer, k, Stopwatch(), resident=resident,
                             abstract=abstract_state(model, optimizer, config.seed))
    carried = programs.carry(init_state(model, optimizer, config.seed))
    batches = resident.args(k)
    carried, rows = programs(k, carried, batches)
    np.asarray(rows)  # compiled and run once

    per_step: dict[int, list[float]] = {gap: [] for gap in args.gaps}
    pool_ticks: dict[int, list[int]] = {gap: [] for gap in args.gaps}
    for _ in range(args.repeats):
        for gap in args.gaps:
            before, calls = thread_cpu_ticks(), []
            for _ in range(args.calls):
                start = time.perf_counter()
                carried, rows = programs(k, carried, batches)
                np.asarray(rows)  # as the loop reads an inline call's rows
                calls.append(time.perf_counter() - start)
                busy(gap)
            after = thread_cpu_ticks()
            main_thread = str(os.getpid())
            pool_ticks[gap].append(sum(after[t] - before.get(t, 0) for t in after
                                       if t != main_thread))
            per_step[gap].append(statistics.median(calls) / k)
    base = min(per_step[args.gaps[0]])
    print(f"trainrun's step program, default MLP, K={k}, {args.calls} calls per gap, "
          f"{args.repeats} interleaved repeats; jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs")
    print(f"| host work after each call | call, µs a step (best) | extra per call vs "
          f"{args.gaps[0]} µs | other threads' CPU ticks (median) |\n|---:|---:|---:|---:|")
    for gap in args.gaps:
        best = min(per_step[gap])
        print(f"| {gap} µs | {best * 1e6:.1f} | {(best - base) * k * 1e6:+.0f} µs | "
              f"{statistics.median(pool_ticks[gap])} |")


if __name__ == "__main__":
    main()
