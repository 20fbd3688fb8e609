"""What the loop costs: the reference chapter's hand-written jitted loop vs trainrun's full run
(Grain batches, metrics.jsonl, logging) on the default MLP, K = 1, 10, 100 steps per call.

    python benchmarks/overhead.py [--steps 2000] [--repeats 5] [--async-dispatch]

Every contender is timed the same way: windows of ``--window`` steps, each ended by
``block_until_ready``, median over the windows after the first; contenders are interleaved
and the median over repeats is reported. Targets: K=1 within 5% of the hand loop; K=10 at
least 3x faster than it.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_parity import chapter_losses  # noqa: F401  (the same chapter code the test uses)

from trainrun import packing
from trainrun.config import load_config
from trainrun.loop import run
from trainrun.process import configure_process


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


def trainrun_step_s(steps: int, window: int, k: int, packed: bool = True) -> float:
    # Periodic checkpoints are their own cost (benchmarks/checkpoint.py); everything else a
    # default run does per step (Grain batches, metrics.jsonl, TensorBoard) is timed here.
    # packed=False: the state crosses the jit boundary leaf by leaf (trainrun.packing off).
    config = load_config("mlp", [f"steps={steps}", f"steps_per_call={k}",
                                 f"log_every={max(window, k)}", "checkpoint.every=0"])
    default_limit = packing.PACK_MAX_BYTES
    packing.PACK_MAX_BYTES = default_limit if packed else 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = run(config, Path(tmp) / "run", out=io.StringIO())
    finally:
        packing.PACK_MAX_BYTES = default_limit
    return summary.step_time_median_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--async-dispatch", action="store_true",
                        help="undo trainrun's inline CPU dispatch (trainrun.process) for "
                             "every contender")
    args = parser.parse_args()
    # trainrun's process settings, as `trainrun train` makes them, before the first computation
    configure_process(inline_cpu_calls=not args.async_dispatch)

    contenders = {
        "hand-written jitted loop": lambda: hand_loop_step_s(args.steps, args.window),
        "hand-written lax.scan, 10 per call": lambda: hand_loop_step_s(args.steps, args.window,
                                                                      10),
        "trainrun K=1": lambda: trainrun_step_s(args.steps, args.window, 1),
        "trainrun K=1, state not packed": lambda: trainrun_step_s(args.steps, args.window, 1,
                                                                  packed=False),
        "trainrun K=10": lambda: trainrun_step_s(args.steps, args.window, 10),
        "trainrun K=100": lambda: trainrun_step_s(args.steps, args.window, 100),
    }
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, measure in contenders.items():
            results[name].append(measure())
    medians = {name: statistics.median(times) for name, times in results.items()}
    base = medians["hand-written jitted loop"]
    dispatch = "asynchronous" if args.async_dispatch else "inline (trainrun's default)"
    print(f"default MLP (8->32->1, batch 256, adam), {args.steps} steps per contender, "
          f"median of {args.repeats} interleaved repeats; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, CPU dispatch {dispatch}")
    print("| contender | µs/step | vs hand loop |\n|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1e6:.1f} | {base / seconds:.2f}x speed |")


if __name__ == "__main__":
    main()
