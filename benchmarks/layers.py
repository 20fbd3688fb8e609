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
from trainrun.platform.process import configure_process

POLICIES = ("none", "dots_with_no_batch_dims_saveable", "dots_saveable", "full")


def compile_step(cfg: TransformerModel, batch: int) -> tuple[float, int, jax.stages.Compiled]:
    """(seconds to lower and compile, characters of the lowered program, the executable)."""
    model = build_model(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), np.int32)
    fn = jax.jit(jax.value_and_grad(
        lambda p, t: model.loss(p, {"tokens": t}, jax.random.key(0))[0]))
    start = time.perf_counter()
    lowered = fn.lower(params, tokens)
    compiled = lowered.compile()
    return time.perf_counter() - start, len(lowered.as_text()), compiled


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
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

    print("Lowering + compile time of the step (s) and the lowered program's size, by depth")
    print("| layers | unrolled s | scan_layers s | unrolled program (kB) | scanned program (kB) |")
    print("|---:|---:|---:|---:|---:|")
    for layers in depths:
        times, sizes = {}, {}
        for scan in (False, True):
            cfg = base.model_copy(update={"layers": layers, "scan_layers": scan})
            runs = [compile_step(cfg, args.batch) for _ in range(args.repeats)]
            times[scan], sizes[scan] = min(r[0] for r in runs), runs[0][1]
        print(f"| {layers} | {times[False]:.2f} | {times[True]:.2f} | "
              f"{sizes[False] / 1e3:,.0f} | {sizes[True] / 1e3:,.0f} |")

    layers = max(depths)
    print(f"\nTemporaries of the step (MB, memory_analysis), {layers} layers, by remat policy")
    print("| remat | unrolled | scan_layers |")
    print("|---|---:|---:|")
    for remat in POLICIES:
        temps = []
        for scan in (False, True):
            cfg = base.model_copy(update={"layers": layers, "scan_layers": scan, "remat": remat})
            temps.append(compile_step(cfg, args.batch)[2].memory_analysis().temp_size_in_bytes)
        print(f"| {remat} | {temps[0] / 1e6:.1f} | {temps[1] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
