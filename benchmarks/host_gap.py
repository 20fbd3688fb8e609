"""How the host's work between calls slows the next call on XLA:CPU, and what handing kernels
to XLA's thread pool costs: trainrun's step program (the default MLP, K steps a call, batches
cut on the device) called back to back, and with ``--gaps`` microseconds of Python work after
each call (a busy loop touching no memory, so no cache is disturbed by it). Two contenders:

- trainrun's program as built: it runs in the calling thread (``fast/packing.py``,
  ``fast/resident.py``);
- the same program as it was built before: the state's slices independent at its start and
  the call's K batches gathered there in one kernel, so XLA:CPU's thunk executor hands kernels
  to its pool (more than 8 ready at once, or one large enough to split) and the call ends on a
  pool thread.

    python benchmarks/host_gap.py [--k 10] [--calls 300] [--repeats 3] [--gaps 0 200 1000 5000]

Contenders and gaps are interleaved within each repeat; the table gives the median call per
step over the calls of the best repeat, the extra time per call against back-to-back calls, and
the pool threads' voluntary context switches per call (a pool thread that was woken sleeps
again: 0 when the calls never reach the pool).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from trainrun.config import load_config
from trainrun.data import build_dataset
from trainrun.fast import packing, resident
from trainrun.fast.strategies import Strategies
from trainrun.models import build_model
from trainrun.platform.process import configure_process
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state, init_state
from trainrun.program.step import make_multi_step
from trainrun.reporting.timing import Stopwatch


def busy(microseconds: float) -> None:
    """Python work for ``microseconds`` of wall time (the loop's own bookkeeping stands in)."""
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


def pool_sleeps() -> int:
    """Voluntary context switches so far of XLA:CPU's pool threads (Linux ``/proc``)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if "XLAEigen" in (task / "comm").read_text():
            status = (task / "status").read_text().splitlines()
            total += int(next(line for line in status
                              if line.startswith("voluntary_ctxt_switches")).split()[1])
    return total


@contextlib.contextmanager
def built_as_before() -> Iterator[None]:
    """While a program is traced: its state's slices independent of each other and the call's
    K batches gathered at its start (one ``[K, rows, ...]`` kernel), then scanned."""

    def cut_up_front(one_row, held, scanned):
        def call(state, args):
            steps = state.step + np.arange(args[1].shape[0], dtype=np.int32)
            batches = jax.vmap(lambda s: held.batch(s, args))(steps)
            return make_multi_step(one_row)(state, batches)
        return call

    unpack, cut = packing.StatePacking.unpack, resident.cut_on_device
    packing.StatePacking.unpack = lambda self, packed: self._unpack(packed, in_order=False)
    resident.cut_on_device = cut_up_front
    try:
        yield
    finally:
        packing.StatePacking.unpack, resident.cut_on_device = unpack, cut


def program(k: int, before: bool):
    """A function making one call of a freshly built and compiled step program."""
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 1000)
    held = resident.ResidentBatches(build_dataset(config.data, seed=config.seed), 0)
    with built_as_before() if before else contextlib.nullcontext():
        abstract, chosen = abstract_state(model, optimizer, config.seed), Strategies()
        programs = CompiledSteps(model, optimizer, k, Stopwatch(), source=held,
                                 abstract=abstract, carrier=chosen.state_carrier(abstract),
                                 keep=chosen.nonfinite_guard(k))
        carried = [programs.carry(init_state(model, optimizer, config.seed))]
        programs.compile(k, carried[0], held.args(k))

    def call() -> None:
        carried[0], rows = programs(k, carried[0], held.args(k))
        np.asarray(rows)  # as the loop reads an inline call's rows

    call()
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gaps", type=int, nargs="+", default=[0, 200, 1000, 5000])
    args = parser.parse_args()
    configure_process()  # as `trainrun train` runs: inline CPU calls, the allocator setting
    k = args.k
    contenders = {"in the calling thread": program(k, before=False),
                  "handing kernels to the pool (before)": program(k, before=True)}
    per_step = {(name, gap): [] for name in contenders for gap in args.gaps}
    sleeps = {(name, gap): [] for name in contenders for gap in args.gaps}
    for _ in range(args.repeats):
        for gap in args.gaps:
            for name, call in contenders.items():
                before, calls = pool_sleeps(), []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    call()
                    calls.append(time.perf_counter() - start)
                    busy(gap)
                sleeps[name, gap].append((pool_sleeps() - before) / args.calls)
                per_step[name, gap].append(statistics.median(calls) / k)
    print(f"trainrun's step program, default MLP, K={k}, {args.calls} calls per gap, "
          f"{args.repeats} interleaved repeats; jax {jax.__version__}, {os.cpu_count()} CPUs")
    print("| program | host work after each call | call, µs a step (best) | extra per call vs "
          f"{args.gaps[0]} µs | pool wakes per call (median) |\n|---|---:|---:|---:|---:|")
    for name in contenders:
        base = min(per_step[name, args.gaps[0]])
        for gap in args.gaps:
            best = min(per_step[name, gap])
            print(f"| {name} | {gap} µs | {best * 1e6:.1f} | {(best - base) * k * 1e6:+.0f} µs "
                  f"| {statistics.median(sleeps[name, gap]):.2f} |")


if __name__ == "__main__":
    main()
