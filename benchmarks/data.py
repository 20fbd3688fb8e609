"""What the data pipeline costs a training step: the LM of ``configs/lm.yaml`` fed by the Grain
pipeline (window gather from the byte corpus, host -> device in the call) vs fed batches that are
already on the device.

    python benchmarks/data.py [--calls 4] [--repeats 5] [key.path=value ...]

Each contender runs the same jitted, donated K-step program (K = ``steps_per_call``) from the
same state; a window is ``--calls`` calls ended by ``block_until_ready``. Contenders are
interleaved, ``--repeats`` windows each, and the median window is reported. Target: the
pipeline at most 1.05x the on-device step time. A second table does the same for the default
MLP, whose ~50 µs step shows any per-batch host cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from trainrun.config import RunConfig, load_config
from trainrun.data import batch_iterator, build_dataset, stack_batches
from trainrun.models import build_model
from trainrun.platform.process import configure_process
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import make_multi_step, make_train_step


def program(config: RunConfig):
    model = build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    step = make_train_step(model, optimizer)
    if config.steps_per_call > 1:
        step = make_multi_step(step)
    return jax.jit(step, donate_argnums=0), init_state(model, optimizer, config.seed)


def contenders(config: RunConfig, calls: int) -> dict[str, Callable[[], Any]]:
    """name -> a function returning the next call's batch."""
    k = config.steps_per_call
    dataset = build_dataset(config.data, seed=config.seed)

    def host_batches(threads: int) -> Callable[[], Any]:
        iterator = batch_iterator(dataset, threads)
        if k == 1:
            return lambda: next(iterator)
        return lambda: stack_batches([next(iterator) for _ in range(k)])

    resident = host_batches(0)
    on_device = [jax.device_put(resident()) for _ in range(calls)]
    jax.block_until_ready(on_device)
    cursor = iter(range(10**12))
    return {
        "data already on device": lambda: on_device[next(cursor) % calls],
        "Grain pipeline, no prefetch": host_batches(0),
        "Grain pipeline, 1 prefetch thread": host_batches(1),
    }


def measure(config: RunConfig, calls: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per contender: (median seconds per step, median host seconds per step spent getting the
    batch: the pipeline's own cost, which the step time hides when prefetching or when the
    device is busy anyway)."""
    fn, state = program(config)
    feeds = contenders(config, calls)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in feeds}
    for feed in feeds.values():  # compile and warm each path once
        state, metrics = fn(state, feed())
    jax.block_until_ready(metrics)
    steps = calls * config.steps_per_call
    for _ in range(repeats):
        for name, feed in feeds.items():
            host = 0.0
            start = time.perf_counter()
            for _ in range(calls):
                fetch = time.perf_counter()
                batch = feed()
                host += time.perf_counter() - fetch
                state, metrics = fn(state, batch)
            jax.block_until_ready((state, metrics))
            times[name].append(((time.perf_counter() - start) / steps, host / steps))
    return {name: (statistics.median(t for t, _ in values), statistics.median(h for _, h in values))
            for name, values in times.items()}


def table(title: str, result: dict[str, tuple[float, float]]) -> str:
    base = result["data already on device"][0]
    unit, scale = ("ms", 1e3) if base > 1e-3 else ("µs", 1e6)
    rows = [f"{title}", f"| contender | {unit}/step | vs on device | host data {unit}/step |",
            "|---|---:|---:|---:|"]
    rows += [f"| {name} | {t * scale:,.1f} | {t / base:.3f}x time | {h * scale:,.3f} |"
             for name, (t, h) in result.items()]
    return "\n".join(rows)


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=4, help="calls per timed window")
    parser.add_argument("--repeats", type=int, default=5, help="windows per contender")
    parser.add_argument("overrides", nargs="*", help="key.path=value for configs/lm.yaml")
    args = parser.parse_args()
    lm = load_config("lm", ["eval.every=0", *args.overrides])
    print(table(f"LM ({lm.model.d_model}d x {lm.model.layers} layers, batch "
                f"{lm.data.batch_size} x {lm.data.seq_len} bytes, K={lm.steps_per_call})",
                measure(lm, args.calls, args.repeats)))
    print()
    mlp = load_config("mlp", ["steps_per_call=1"])
    print(table("default MLP (batch 256, K=1)", measure(mlp, 200, args.repeats)))
    print(f"\njax {jax.__version__}, {jax.devices()[0].device_kind}, numpy {np.__version__}")


if __name__ == "__main__":
    main()
