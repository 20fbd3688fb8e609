"""What ``metrics.stream`` costs: the default MLP at K=10 steps per call, metrics read once per
log window (the default) vs streamed out of each call step by step through an ordered
``io_callback``. K=1 is shown for reference.

    python benchmarks/streaming.py [--steps 5000] [--repeats 3]

Each contender is a whole ``trainrun`` run (metrics.jsonl and TensorBoard written, as by
default), interleaved with the others, median over repeats. Two figures per run:

    loop µs/step   the training loop's wall time per step, compile excluded: dispatch, waits,
                   data, and writing the metrics (streamed rows are written inside the call)
    device µs/step the median device time per step over timing windows (``summary.json``)

On XLA:CPU a program with host callbacks runs synchronously in the dispatching thread, so the
streamed run also loses the overlap of host and device; on GPU/TPU it keeps it.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
from pathlib import Path

import jax

from trainrun.config import load_config
from trainrun.platform.process import configure_process
from trainrun.training.loop import run


def measure(steps: int, k: int, stream: bool) -> tuple[float, float]:
    config = load_config("mlp", [f"steps={steps}", f"steps_per_call={k}", "metrics.every=500",
                                 "checkpoint.every=0", f"metrics.stream={str(stream).lower()}"])
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(config, Path(tmp) / "run", out=io.StringIO())
    split = summary.wall_time_split_s
    loop_s = split["step_compute"] + split["data_wait"] + split["logging"]
    return loop_s / steps, summary.step_time_median_s


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    contenders = {
        "K=1 (reference)": (1, False),
        "K=10, read per log window": (10, False),
        "K=10, metrics.stream": (10, True),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, (k, stream) in contenders.items():
            results[name].append(measure(args.steps, k, stream))
    loop = {n: statistics.median(r[0] for r in rs) for n, rs in results.items()}
    device = {n: statistics.median(r[1] for r in rs) for n, rs in results.items()}
    base = "K=10, read per log window"
    print(f"default MLP (8->32->1, batch 256, adam), {args.steps} steps per run, median of "
          f"{args.repeats} interleaved repeats; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}")
    print("| contender | loop µs/step | vs K=10 read | device µs/step | vs K=10 read |")
    print("|---|---:|---:|---:|---:|")
    for name in contenders:
        print(f"| {name} | {loop[name] * 1e6:.1f} | {loop[name] / loop[base]:.2f}x time | "
              f"{device[name] * 1e6:.1f} | {device[name] / device[base]:.2f}x time |")


if __name__ == "__main__":
    main()
