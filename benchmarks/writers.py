"""What writing a step's metrics costs the host: trainrun's writers, and tensorboardX's stock
``SummaryWriter.add_scalar`` for comparison, on rows like the default MLP's (5 metrics).

    python benchmarks/writers.py [--rows 20000] [--repeats 3]

Rows are written in windows of 50 as the loop writes them at log points: a table (one float32
array per window, ``RunOutput.write_table``), and for comparison row by row (a one-row table
each, the path of ``metrics.stream``). Each contender writes the same rows
to its own temporary directory, interleaved, median over repeats.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from trainrun.platform.process import configure_process
from trainrun.reporting.console import ConsoleLog
from trainrun.reporting.run_output import build_output
from trainrun.reporting.sinks.tensorboard import _tensorboardx
from trainrun.reporting.sinks.wandb import WandbWriter
from trainrun.reporting.table import Table

ROW = {"grad_norm": 1.2345678, "loss": 0.123456789, "loss_scale": 1.0, "lr": 0.01,
       "nonfinite_steps": 0.0}


def trainrun_writers(rows: int, tensorboard: bool, wandb: bool, tables: bool = True) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        output = build_output(Path(tmp), ConsoleLog(rows, 256, io.StringIO()), log_every=50,
                              total_steps=rows, primary=True, tensorboard=tensorboard)
        if wandb:
            output.writers.append(WandbWriter(Path(tmp), {}, "bench", "offline", "bench",
                                              every=50, total_steps=rows))
        names = sorted(ROW)
        window = np.tile(np.array([ROW[n] for n in names], np.float32), (50, 1))
        start = time.perf_counter()
        for first in range(1, rows + 1, 50):
            if tables:  # the loop's path: the window as read from the device
                output.write_table(Table(first, names, window.copy()))
            else:  # metrics.stream's path: each row as it arrives
                for step in range(first, first + 50):
                    output.write_table(Table(step, names, window[:1].copy()))
        elapsed = time.perf_counter() - start
        output.close()
    return elapsed / rows


def stock_summary_writer(rows: int) -> float:
    _tensorboardx()  # imports tensorboardX without torch, as trainrun does
    from tensorboardX import SummaryWriter

    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(tmp)
        start = time.perf_counter()
        for step in range(1, rows + 1):
            for name, value in ROW.items():
                writer.add_scalar(f"train/{name}", value, step)
        elapsed = time.perf_counter() - start
        writer.close()
    return elapsed / rows


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    contenders = {
        "metrics.jsonl only": lambda: trainrun_writers(args.rows, False, False),
        "jsonl + TensorBoard (default)": lambda: trainrun_writers(args.rows, True, False),
        "jsonl + TensorBoard, row by row": lambda: trainrun_writers(args.rows, True, False,
                                                                    tables=False),
        "jsonl + TensorBoard + W&B offline (log points)": lambda: trainrun_writers(
            args.rows // 10, True, True),
        "tensorboardX SummaryWriter.add_scalar": lambda: stock_summary_writer(args.rows // 10),
    }
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, measure in contenders.items():
            results[name].append(measure())
    medians = {name: statistics.median(times) for name, times in results.items()}
    base = medians["metrics.jsonl only"]
    print(f"{len(ROW)} metrics per row, windows of 50 rows, {args.rows} rows (W&B and "
          f"add_scalar: {args.rows // 10}), median of {args.repeats} interleaved repeats")
    print("| writers | µs per row | vs jsonl only |\n|---|---:|---:|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds * 1e6:.1f} | {seconds / base:.2f}x time |")


if __name__ == "__main__":
    main()
