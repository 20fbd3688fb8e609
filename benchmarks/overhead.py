"""What the loop costs: the reference chapter's hand-written jitted loop, and its bare
``lax.scan`` of 10 and of 100 steps, against trainrun's whole run (a batch a step from the
dataset, every step's metrics read back and written to metrics.jsonl and TensorBoard, log
lines, hooks) on the default
MLP, at K = 1, 10, 100 steps per call (at K=10 and 100 also with the rows written in the
loop's thread, as before the writer thread); then the default MLP run with the default
checkpoint policy against the same run without checkpoints.

    python benchmarks/overhead.py [--steps 2000] [--repeats 5] [--async-dispatch]

Every contender is timed the same way: windows of ``--window`` steps, each ended by a blocking
read, by the wall clock, median over the windows after the first; contenders are interleaved
and the best and the median over repeats are reported (on a machine shared with other work
the best is the one least disturbed by it). trainrun's windows are the time between the
dispatch of its calls ``--window`` steps apart (``CallClock``, a wrapper on its program's
call; each call has finished when it returns, the loop waits for it): everything the loop
does on the host between those calls is inside them. Periodic checkpoints are
off in the first table (the second one is about them). Targets: K=1 within 10% of the hand
loop; K=10 within 1.5x of the bare scan of 10; K=100 within 1.2x of the bare scan of 100.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import trainrun
from trainrun.config import load_config
from trainrun.data import batch_iterator, build_dataset, stack_batches
from trainrun.fast.strategies import Strategies
from trainrun.models import build_model
from trainrun.platform import fast_paths
from trainrun.platform.process import configure_process
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state, init_state
from trainrun.reporting.timing import Stopwatch
from trainrun.training.loop import run


def hand_loop_step_s(steps: int, window: int, per_call: int = 1) -> float:
    """The chapter's loop as written: device-resident (x, y), never reading the loss.
    ``per_call`` > 1: the same step under ``lax.scan``, that many per call (the chapter's
    figure for scanned steps), on the same batch each step: no data loading, no metrics."""

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (8, 32)) * 0.1, "b1": jnp.zeros(32),
                "w2": jax.random.normal(k2, (32, 1)) * 0.1, "b2": jnp.zeros(1)}

    def loss_fn(p, batch):
        x, y = batch
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    opt = optax.adam(1e-2)

    @jax.jit
    def train_step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    @jax.jit
    def scanned_steps(p, opt_state, batch):
        def body(carry, _):
            p, opt_state, loss = train_step(*carry, batch)
            return (p, opt_state), loss

        (p, opt_state), losses = jax.lax.scan(body, (p, opt_state), None, length=per_call)
        return p, opt_state, losses

    call = train_step if per_call == 1 else scanned_steps
    params = init(jax.random.key(0))
    opt_state = opt.init(params)
    x = jax.random.normal(jax.random.key(1), (256, 8))
    batch = (x, jnp.sum(x, axis=1, keepdims=True))
    params, opt_state, loss = call(params, opt_state, batch)  # compile
    jax.block_until_ready(loss)
    per_step = []
    last = time.perf_counter()
    for i in range(1, steps // per_call + 1):
        params, opt_state, loss = call(params, opt_state, batch)
        if i * per_call % window == 0:
            jax.block_until_ready(loss)
            now = time.perf_counter()
            per_step.append((now - last) / window)
            last = now
    return statistics.median(per_step[1:])


def program_step_s(steps: int, window: int, k: int) -> float:
    """trainrun's own K-step program (its step: the non-finite guard, three norms, the lr and
    every metric), called in a bare loop like the chapter's scan: one stacked batch on the
    device, no data loading, metrics never read. What the program costs apart from the loop."""
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, steps)
    abstract, chosen = abstract_state(model, optimizer, config.seed), Strategies()  # all on
    programs = CompiledSteps(model, optimizer, k, Stopwatch(), abstract=abstract,
                             carrier=chosen.state_carrier(abstract),
                             keep=chosen.nonfinite_guard(k))
    carried = programs.carry(init_state(model, optimizer, config.seed))
    batches = batch_iterator(build_dataset(config.data, seed=config.seed))
    batch = jax.device_put(stack_batches([next(batches) for _ in range(k)]))
    carried, packed = programs(k, carried, batch)  # compile
    packed.block_until_ready()
    per_step, last = [], time.perf_counter()
    for i in range(1, steps // k + 1):
        carried, packed = programs(k, carried, batch)
        if i * k % window == 0:
            packed.block_until_ready()
            now = time.perf_counter()
            per_step.append((now - last) / window)
            last = now
    return statistics.median(per_step[1:])


class CallClock:
    """Stamps each dispatch of the run's step program (about 0.3 µs a call); wall time per
    step over windows of ``every`` steps between stamps: the loop's whole cost, host work
    between the calls included (a callback would add its own cost to every boundary)."""

    def __init__(self, every: int):
        self.every = every
        self.marks: list[tuple[int, float]] = []
        self.steps = 0

    def __enter__(self) -> CallClock:
        self.original = original = CompiledSteps.__call__
        clock = self

        def stamped(programs, k, carried, batch):
            if clock.steps % clock.every == 0:
                clock.marks.append((clock.steps, time.perf_counter()))
            clock.steps += k
            return original(programs, k, carried, batch)

        CompiledSteps.__call__ = stamped
        return self

    def __exit__(self, *exc: object) -> None:
        CompiledSteps.__call__ = self.original

    def median_step_s(self) -> float:
        spans = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1)
                 in zip(self.marks, self.marks[1:], strict=False)]
        return statistics.median(spans[1:])  # the first window after compile: warmup


PLAIN = ("state_packing", "resident_batches", "writer_thread", "guard_branches")


def trainrun_step_s(steps: int, window: int, k: int, without: tuple[str, ...] = ()) -> float:
    """trainrun's whole run at ``k`` steps per call; ``without``: fast paths turned off
    (``TRAINRUN_FAST_PATHS``; inline CPU calls are the process's, set in ``main``)."""
    config = load_config("mlp", [f"steps={steps}", f"steps_per_call={k}",
                                 f"metrics.every={max(window, k)}", "checkpoint.every=0",
                                 "checkpoint.every_seconds=0"])
    kept = [name for name in fast_paths.names() if name not in without]
    before = os.environ.get(fast_paths.ENVIRONMENT_VARIABLE)
    os.environ[fast_paths.ENVIRONMENT_VARIABLE] = ",".join(kept) or "none"
    try:
        with tempfile.TemporaryDirectory() as tmp, CallClock(max(window, k)) as clock:
            run(config, Path(tmp) / "run", out=io.StringIO())
    finally:
        if before is None:
            del os.environ[fast_paths.ENVIRONMENT_VARIABLE]
        else:
            os.environ[fast_paths.ENVIRONMENT_VARIABLE] = before
    return clock.median_step_s()


class Saves(trainrun.Callback):
    """Counts the checkpoints a run saves."""

    def __init__(self) -> None:
        self.count = 0

    def on_checkpoint(self, boundary: trainrun.Boundary) -> None:
        self.count += 1


def policy_run(steps: int, overrides: list[str]) -> tuple[float, list[float], int]:
    """The default MLP through run() as `trainrun train steps=N metrics.every=N/4` runs it:
    (median step time from its summary, the console's steps/s per log line, saves)."""
    config = load_config("mlp", [f"steps={steps}", f"metrics.every={steps // 4}", *overrides])
    out, saves = io.StringIO(), Saves()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(config, Path(tmp) / "run", out=out, callbacks=[saves])
    rates = [float(line.split("steps/s")[0].split()[-1].replace(",", ""))
             for line in out.getvalue().splitlines() if line.startswith("step ")]
    return summary.step_time_median_s, rates, saves.count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-dispatch", action="store_true",
                        help="keep XLA:CPU's asynchronous dispatch (trainrun.platform.process) for "
                             "every contender")
    args = parser.parse_args()
    # trainrun's process settings, as `trainrun train` makes them, before the first computation
    configure_process(inline_cpu_calls=not args.async_dispatch)

    s, w = args.steps, args.window
    contenders = {
        "hand-written jitted loop": lambda: hand_loop_step_s(s, w),
        "hand-written lax.scan, 10 per call": lambda: hand_loop_step_s(s, w, 10),
        "hand-written lax.scan, 100 per call": lambda: hand_loop_step_s(s, w, 100),
        "trainrun's step program alone, 10 per call": lambda: program_step_s(s, w, 10),
        "trainrun's step program alone, 100 per call": lambda: program_step_s(s, w, 100),
        "trainrun K=1": lambda: trainrun_step_s(s, w, 1),
        "trainrun K=1, state not packed": lambda: trainrun_step_s(s, w, 1, ("state_packing",)),
        "trainrun K=10": lambda: trainrun_step_s(s, w, 10),
        "trainrun K=10, rows written inline": lambda: trainrun_step_s(s, w, 10,
                                                                     ("writer_thread",)),
        "trainrun K=100": lambda: trainrun_step_s(s, w, 100),
        "trainrun K=100, rows written inline": lambda: trainrun_step_s(s, w, 100,
                                                                      ("writer_thread",)),
        "trainrun K=10, the plain path (fast paths off but inline calls)":
            lambda: trainrun_step_s(s, w, 10, PLAIN),
    }
    results: dict[str, list[float]] = {name: [] for name in contenders}
    policies = {"no checkpoints (every=0, every_seconds=0)":
                ["checkpoint.every=0", "checkpoint.every_seconds=0"],
                "default policy (every_seconds=300)": [],
                "every=100 steps (the old default)": ["checkpoint.every=100"]}
    policy_results: dict[str, list[tuple[float, list[float], int]]] = {n: [] for n in policies}
    for _ in range(args.repeats):
        for name, measure in contenders.items():
            results[name].append(measure())
        for name, overrides in policies.items():
            policy_results[name].append(policy_run(s, overrides))
    best = {name: min(times) for name, times in results.items()}
    medians = {name: statistics.median(times) for name, times in results.items()}
    dispatch = "asynchronous" if args.async_dispatch else "inline (trainrun's default)"
    print(f"default MLP (8->32->1, batch 256, adam), {s} steps per contender, windows of {w}, "
          f"{args.repeats} interleaved repeats; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, CPU dispatch {dispatch}")
    print("| contender | µs/step, best | µs/step, median | vs hand loop (best) | vs bare scan of "
          "the same K (best) |\n|---|---:|---:|---:|---:|")
    bare = {"trainrun K=10": "hand-written lax.scan, 10 per call",
            "trainrun K=100": "hand-written lax.scan, 100 per call",
            "trainrun K=1": "hand-written jitted loop"}
    for name, seconds in best.items():
        ratio = f"{seconds / best[bare[name]]:.2f}x the time" if name in bare else ""
        print(f"| {name} | {seconds * 1e6:.1f} | {medians[name] * 1e6:.1f} | "
              f"{best['hand-written jitted loop'] / seconds:.2f}x speed | {ratio} |")
    print(f"\ndefault MLP, {s} steps, metrics.every={s // 4}, through run(); "
          f"{args.repeats} repeats")
    print("| checkpoints | saves | step_time_median_s µs, best / median | console steps/s per "
          "log line (the run with the best step time) | their max/min, best / median |\n"
          "|---|---:|---:|---|---:|")
    for name, runs in policy_results.items():
        steps = [r[0] for r in runs]
        spreads = [max(r[1]) / min(r[1]) for r in runs]
        rates = min(runs, key=lambda r: r[0])[1]
        print(f"| {name} | {runs[0][2]} | {min(steps) * 1e6:.1f} / "
              f"{statistics.median(steps) * 1e6:.1f} | {', '.join(f'{r:,.0f}' for r in rates)} | "
              f"{min(spreads):.2f} / {statistics.median(spreads):.2f} |")


if __name__ == "__main__":
    main()
