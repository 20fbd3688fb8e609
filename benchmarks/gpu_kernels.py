"""Per-kernel device time from a jax.profiler trace (made with ``create_perfetto_trace=True``):
it summarizes the perfetto trace per kernel name. Adapted from ``kernels.py`` of the project's
notes on its GPU machine.

    python benchmarks/gpu_kernels.py TRACE_DIR [STEPS] [TOP]

TRACE_DIR: the directory given to jax.profiler.start_trace; STEPS: how many steps the trace
covers (times are divided by it); TOP: how many kernel names to print (default 40).
Prints the device's total time per step and the largest kernels: ms per step, calls per step,
name. GEMM kernel names tell the operand types (e.g. 'f32f32_tf32f32' = float32 operands on
TF32 tensor cores; 'nvjet...h' or 'bf16' = half precision); cuDNN attention shows as
'...sdpa...flash...'.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import sys
from dataclasses import dataclass


@dataclass
class Kernels:
    """Device time (microseconds) and calls per kernel name, over the whole trace."""

    total_us: collections.Counter
    calls: collections.Counter

    def per_step_ms(self, steps: int) -> float:
        return sum(self.total_us.values()) / steps / 1e3


def read_trace(trace_dir: str) -> Kernels:
    files = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}: trace with "
                                "create_perfetto_trace=True")
    with gzip.open(files[-1]) as f:
        data = json.loads(f.read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and "/device:" in names.get(e.get("pid"), ""):
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return Kernels(total, calls)


def table(kernels: Kernels, steps: int, top: int = 40) -> str:
    lines = [f"device time {kernels.per_step_ms(steps):.1f} ms per step, "
             f"{len(kernels.total_us)} kernel names", "",
             "| ms/step | calls/step | kernel |", "|---:|---:|---|"]
    for name, us in kernels.total_us.most_common(top):
        lines.append(f"| {us / steps / 1e3:.2f} | {kernels.calls[name] / steps:.1f} | "
                     f"`{name[:120]}` |")
    return "\n".join(lines)


def main() -> None:
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    try:
        kernels = read_trace(sys.argv[1])
    except FileNotFoundError as err:
        sys.exit(str(err))
    print(table(kernels, steps, top))


if __name__ == "__main__":
    main()
