"""The transformer's program by how its layers are built: compile time by depth (unrolled
Python layers against one block under ``lax.scan``) and the training step's temporaries by
rematerialization policy (XLA's ``memory_analysis()`` of the compiled step).

    python benchmarks/layers.py [--depths 2,4,8,16] [--d-model 256] [--seq 256] [--batch 16]

Each program is the loss's value and gradient, compiled from scratch in this process
(``jit(...).lower(...).compile()`` on abstract shapes: nothing runs). Compile time is wall time
of lowering plus compiling, the best of ``--repeats``; XLA's persistent cache is off.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from trainrun.config import TransformerModel
from trainrun.models import build_model

POLICIES = ("none", "dots_with_no_batch_dims_saveable", "dots_saveable", "full")


def compile_step(cfg: TransformerModel, batch: int) -> tuple[float, jax.stages.Compiled]:
    model = build_model(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), np.int32)
    fn = jax.jit(jax.value_and_grad(
        lambda p, t: model.loss(p, {"tokens": t}, jax.random.key(0))[0]))
    start = time.perf_counter()
    compiled = fn.lower(params, tokens).compile()
    return time.perf_counter() - start, compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="2,4,8,16")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    depths = [int(d) for d in args.depths.split(",")]
    base = TransformerModel(d_model=args.d_model, heads=max(1, args.d_model // 64),
                            seq_len=args.seq, vocab=256)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; d_model {args.d_model}, "
          f"seq {args.seq}, batch {args.batch}, float32\n")

    print("Compile time of the step (s), by depth")
    print("| layers | unrolled | scan_layers | scan / unrolled |")
    print("|---:|---:|---:|---:|")
    for layers in depths:
        times = {}
        for scan in (False, True):
            cfg = base.model_copy(update={"layers": layers, "scan_layers": scan})
            times[scan] = min(compile_step(cfg, args.batch)[0] for _ in range(args.repeats))
        print(f"| {layers} | {times[False]:.2f} | {times[True]:.2f} | "
              f"{times[True] / times[False]:.2f} |")

    layers = max(depths)
    print(f"\nTemporaries of the step (MB, memory_analysis), {layers} layers, by remat policy")
    print("| remat | unrolled | scan_layers |")
    print("|---|---:|---:|")
    for remat in POLICIES:
        temps = []
        for scan in (False, True):
            cfg = base.model_copy(update={"layers": layers, "scan_layers": scan, "remat": remat})
            temps.append(compile_step(cfg, args.batch)[1].memory_analysis().temp_size_in_bytes)
        print(f"| {remat} | {temps[0] / 1e6:.1f} | {temps[1] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
