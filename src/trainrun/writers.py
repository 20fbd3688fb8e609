"""Where metrics go: the only module that writes them.

Every writer takes one step's metrics as plain Python floats. ``metrics.jsonl`` always; more
writers (TensorBoard, W&B) implement the same two methods.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, TextIO


class Writer(Protocol):
    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None: ...

    def close(self) -> None: ...


def _number(value: float) -> float | None:
    # float32 -> Python float is exact and json writes the shortest repr that reads back to the
    # same double, so np.float32(loaded) == the value the device produced, bit for bit.
    # JSON has no NaN/inf: they are written as null (and named in the line's "nonfinite").
    return value if math.isfinite(value) else None


class JsonlWriter:
    """``metrics.jsonl``: one JSON object per step (and per eval), appended."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1 << 16)

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        record: dict[str, object] = {"step": step}
        if split != "train":
            record["split"] = split
        bad = []
        for name, value in metrics.items():
            record[name] = _number(value)
            if record[name] is None:
                bad.append(name)
        if bad:
            record["nonfinite"] = bad
        self.file.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path: Path, split: str = "train") -> list[dict]:
    """The records of one split from a ``metrics.jsonl``, in file order."""
    with path.open() as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("split", "train") == split]


class ConsoleLog:
    """Plain log lines every ``log_every`` steps: step, loss, lr, steps/s, examples/s."""

    def __init__(self, total_steps: int, examples_per_step: int, out: TextIO = sys.stdout):
        self.total = total_steps
        self.examples_per_step = examples_per_step
        self.out = out

    def line(self, step: int, metrics: Mapping[str, float], steps_per_s: float) -> None:
        width = len(str(self.total))
        self.out.write(
            f"step {step:>{width}}/{self.total}  loss {metrics['loss']:.6g}  "
            f"lr {metrics['lr']:.3g}  {steps_per_s:,.1f} steps/s  "
            f"{steps_per_s * self.examples_per_step:,.0f} examples/s\n")
        self.out.flush()

    def message(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()
