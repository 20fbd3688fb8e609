"""Step time by compute dtype: float32 against bfloat16 (and float16 with its loss scale), the
same model, batch and optimizer; params and optimizer state stay float32 masters.

    python benchmarks/precision.py [--config mlp-wide|lm] [--dtypes float32,bfloat16]
                                   [key=value ...]

The contenders' compiled steps run interleaved, ``--rounds`` rounds of ``--steps`` steps each,
every round ended by ``block_until_ready``; the median round is reported, with the speed
relative to float32. Compile time is excluded. XLA's CPU backend has no native bfloat16
matmul on most x86 cores, so expect bfloat16 to be slower there; on GPUs and TPUs it is the
fast path (benchmarks/gpu_precision.sh).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from accumulate import PRESETS, compile_step

from trainrun.config import load_config
from trainrun.platform.process import configure_process


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="mlp-wide", choices=sorted(PRESETS))
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="compute dtypes to compare (float32, bfloat16, float16)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = parser.parse_args()
    name, preset = PRESETS[args.config]
    dtypes = args.dtypes.split(",")

    contenders = {}
    for dtype in dtypes:
        config = load_config(name, [*preset, *args.overrides, f"precision.compute={dtype}"])
        compiled, state, batch = compile_step(config)
        contenders[dtype] = {"fn": compiled, "state": state, "batch": batch, "times": []}
    losses = {}
    for dtype, c in contenders.items():  # warm up; the first loss shows they agree
        c["state"], metrics = c["fn"](c["state"], c["batch"])
        losses[dtype] = float(metrics["loss"])
    for _ in range(args.rounds):
        for c in contenders.values():
            start = time.perf_counter()
            for _ in range(args.steps):
                c["state"], metrics = c["fn"](c["state"], c["batch"])
            jax.block_until_ready((c["state"], metrics))
            c["times"].append((time.perf_counter() - start) / args.steps)

    base = statistics.median(contenders[dtypes[0]]["times"])
    print(f"{args.config}: {config.model.kind}, batch {config.data.batch_size}, "
          f"{config.optimizer.name}; jax {jax.__version__}, {jax.devices()[0].device_kind} "
          f"x{jax.device_count()}; median of {args.rounds} interleaved rounds of "
          f"{args.steps} steps; matmul precision "
          f"{jax.config.jax_default_matmul_precision or 'default'}")
    print(f"| compute dtype | ms/step | speed vs {dtypes[0]} | first-step loss |")
    print("|---|---:|---:|---:|")
    for dtype, c in contenders.items():
        seconds = statistics.median(c["times"])
        print(f"| {dtype} | {seconds * 1e3:.2f} | {base / seconds:.2f}x | {losses[dtype]:.5f} |")


if __name__ == "__main__":
    main()
