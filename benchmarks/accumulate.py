"""Memory and time of gradient accumulation: one batch of B against M microbatches of B/M
scanned inside the one step (``accumulate=M``), same model, same global batch.

    python benchmarks/accumulate.py [--config mlp-wide|lm] [--ms 1,2,4,8] [key=value ...]

Peak temporary memory is what XLA's compiled program reports (``memory_analysis()``: buffers
the step allocates beyond its arguments and outputs: activations, gradients, the accumulator),
so it is exact and noise-free. Step time: the contenders' compiled steps run interleaved,
``--rounds`` rounds of ``--steps`` steps each, every round ended by ``block_until_ready``;
the median round is reported. Target: temp memory with M=8 at most 1/4 of M=1's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from trainrun.config import load_config
from trainrun.data import batch_iterator, build_dataset
from trainrun.models import build_model
from trainrun.platform.process import configure_process
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import init_state
from trainrun.program.step import make_train_step

PRESETS = {
    # An MLP whose activations outweigh its params, the case accumulation is for:
    # 256 -> 1024 -> 1024 -> 1 (1.3 M params), batch 16384.
    "mlp-wide": ("mlp", ["model.features=256", "model.hidden=[1024,1024]",
                         "data.features=256", "data.examples=16384", "data.batch_size=16384"]),
    # The byte-level transformer LM of configs/lm.yaml at batch 64 x 128 bytes.
    "lm": ("lm", ["data.batch_size=64", "data.prefetch_threads=0"]),
}


def compile_step(config, accumulate: int = 1):
    """The config's train step, jitted with the state donated and compiled for one batch;
    with the fresh state and that batch (on the device)."""
    model = build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    policy = policy_from_config(config.precision)
    state = init_state(model, optimizer, config.seed, policy)
    batch = next(batch_iterator(build_dataset(config.data, seed=config.seed)))
    step = jax.jit(make_train_step(model, optimizer, accumulate=accumulate, policy=policy),
                   donate_argnums=0)
    compiled = step.lower(state, batch).compile()
    return compiled, state, jax.device_put(batch)


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="mlp-wide", choices=sorted(PRESETS))
    parser.add_argument("--ms", default="1,2,4,8", help="accumulate values to compare")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args()
    name, preset = PRESETS[args.config]
    config = load_config(name, [*preset, *args.overrides])
    ms = [int(m) for m in args.ms.split(",")]

    contenders = {}
    for m in ms:
        compiled, state, batch = compile_step(config, m)
        contenders[m] = {"fn": compiled, "state": state, "batch": batch,
                         "mem": compiled.memory_analysis(), "times": []}
    for c in contenders.values():  # warm up
        c["state"], metrics = c["fn"](c["state"], c["batch"])
        jax.block_until_ready(metrics)
    for _ in range(args.rounds):
        for c in contenders.values():
            start = time.perf_counter()
            for _ in range(args.steps):
                c["state"], metrics = c["fn"](c["state"], c["batch"])
            jax.block_until_ready((c["state"], metrics))
            c["times"].append((time.perf_counter() - start) / args.steps)

    batch_size = config.data.batch_size
    base = contenders[ms[0]]
    base_temp, base_time = base["mem"].temp_size_in_bytes, statistics.median(base["times"])
    print(f"{args.config}: {config.model.kind}, global batch {batch_size}, "
          f"{config.optimizer.name}; jax {jax.__version__}, {jax.devices()[0].device_kind} "
          f"x{jax.device_count()}; median of {args.rounds} interleaved rounds of "
          f"{args.steps} steps")
    print("| accumulate M | microbatch | temp memory MiB | vs M=1 | arguments MiB "
          "| ms/step | vs M=1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m, c in contenders.items():
        temp, seconds = c["mem"].temp_size_in_bytes, statistics.median(c["times"])
        print(f"| {m} | {batch_size // m} | {temp / 2**20:.1f} | {temp / base_temp:.3f} | "
              f"{c['mem'].argument_size_in_bytes / 2**20:.1f} | {seconds * 1e3:.1f} | "
              f"{seconds / base_time:.2f}x |")


if __name__ == "__main__":
    main()
