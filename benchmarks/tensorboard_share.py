"""What writing TensorBoard events costs a step of the digits CNN and the byte LM: trainrun's
``TensorBoardWriter`` against tensorboardX's stock ``SummaryWriter.add_scalar`` (an event a
scalar) and its ``FileWriter.add_summary`` (an event a row), as a share of each model's step
time on this machine.

    python benchmarks/tensorboard_share.py [--steps 2000] [--repeats 5] [--train-steps 1000 200]

For each workload a short ``trainrun train --config <name>`` run gives the metric names (its
``metrics.jsonl`` and ``timing.jsonl``) and the step time (``step_time_median_s`` in its
``summary.json``). Then each contender writes the same rows for ``--steps`` steps as the loop
hands them over: training rows in tables of ``metrics.every`` rows (float32, as read from the
device), a ``perf/`` row after each table and an eval row every ``eval.every`` steps; timed
from the writer's creation to its ``close`` (every event on disk, a writer thread's queue
drained), wall clock and the process's CPU time. Contenders are interleaved in one process;
best and median over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainrun.config import load_config
from trainrun.reporting.sinks.tensorboard import TensorBoardWriter, _tensorboardx
from trainrun.reporting.table import Table


@dataclass
class Workload:
    name: str
    train: list[str]  # a training row's metric names
    perf: list[str]  # a timing window's
    evals: list[str]  # an eval row's
    table_rows: int  # log_every: the rows of one table
    eval_every: int
    step_s: float  # step_time_median_s of the short run


def measure_workload(config: str, steps: int) -> Workload:
    """Metric names and step time from a short real run of ``config``."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "trainrun", "train", "--config", config,
                        f"steps={steps}", "--run-dir", str(run_dir)],
                       check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        timing = json.loads((run_dir / "timing.jsonl").open().readline())
        summary = json.loads((run_dir / "summary.json").read_text())
    train = [k for k in records[0] if k != "step"]
    evals = next(k for k in (list(r) for r in records if r.get("split") == "eval"))
    cfg = load_config(config)
    return Workload(config, train, [k for k in timing if k != "step"],
                    [k for k in evals if k not in ("step", "split")], cfg.metrics.every,
                    cfg.eval.every, summary["step_time_median_s"])


def trainrun_writer(work: Workload, steps: int, values: np.ndarray, logdir: Path) -> None:
    writer = TensorBoardWriter(logdir)
    perf = dict.fromkeys(work.perf, 1e-3)
    evals = dict.fromkeys(work.evals, 0.5)
    for first in range(1, steps + 1, work.table_rows):
        table = Table(first, work.train, values[first - 1:first - 1 + work.table_rows].copy())
        writer.write_table(table)
        writer.write(table.last, perf, "perf")
        if table.last % work.eval_every == 0:
            writer.write(table.last, evals, "eval")
    writer.close()


def summary_writer(work: Workload, steps: int, values: np.ndarray, logdir: Path) -> None:
    _tensorboardx()  # imports tensorboardX without torch, as trainrun does
    from tensorboardX import SummaryWriter

    writer = SummaryWriter(str(logdir))
    for first in range(1, steps + 1, work.table_rows):
        rows = values[first - 1:first - 1 + work.table_rows].tolist()  # as the loop reads them
        for step, row in enumerate(rows, first):
            for name, value in zip(work.train, row, strict=True):
                writer.add_scalar(f"train/{name}", value, step)
        last = first + len(rows) - 1
        for name in work.perf:
            writer.add_scalar(f"perf/{name}", 1e-3, last)
        if last % work.eval_every == 0:
            for name in work.evals:
                writer.add_scalar(f"eval/{name}", 0.5, last)
    writer.close()


def file_writer(work: Workload, steps: int, values: np.ndarray, logdir: Path) -> None:
    """tensorboardX's FileWriter with one event a row (all of its scalars), as trainrun writes."""
    _tensorboardx()
    from tensorboardX import FileWriter
    from tensorboardX.proto.summary_pb2 import Summary

    def summary(split: str, names: list[str], row: list[float]) -> Summary:
        return Summary(value=[Summary.Value(tag=f"{split}/{name}", simple_value=value)
                              for name, value in zip(names, row, strict=True)])

    writer = FileWriter(str(logdir))
    for first in range(1, steps + 1, work.table_rows):
        rows = values[first - 1:first - 1 + work.table_rows].tolist()
        for step, row in enumerate(rows, first):
            writer.add_summary(summary("train", work.train, row), step)
        last = first + len(rows) - 1
        writer.add_summary(summary("perf", work.perf, [1e-3] * len(work.perf)), last)
        if last % work.eval_every == 0:
            writer.add_summary(summary("eval", work.evals, [0.5] * len(work.evals)), last)
    writer.close()


Contender = Callable[[Workload, int, np.ndarray, Path], None]


def timed(contender: Contender, work: Workload, steps: int,
          values: np.ndarray) -> tuple[float, float]:
    """Wall and CPU seconds per step, from the writer's creation to its close."""
    with tempfile.TemporaryDirectory() as tmp:
        wall, cpu = time.perf_counter(), time.process_time()
        contender(work, steps, values, Path(tmp))
        return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000, help="steps of rows written per try")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-steps", type=int, nargs=2, default=[1000, 200],
                        metavar=("DIGITS", "LM"), help="steps of the short runs")
    args = parser.parse_args()
    workloads = [measure_workload("digits", args.train_steps[0]),
                 measure_workload("lm", args.train_steps[1])]
    contenders: dict[str, Contender] = {
        "trainrun TensorBoardWriter (write_table)": trainrun_writer,
        "tensorboardX SummaryWriter.add_scalar": summary_writer,
        "tensorboardX FileWriter.add_summary, one event a row": file_writer,
    }
    rng = np.random.default_rng(0)
    print(f"{args.steps} steps of rows per try, best / median of {args.repeats} interleaved "
          "repeats; share: wall time a step / the model's step time\n")
    print("| workload (metrics a row, rows a table) | step time ms | writer | wall µs a step, "
          "best / median | CPU µs a step, median | share of the step, best / median |")
    print("|---|---:|---|---:|---:|---:|")
    for work in workloads:
        values = rng.normal(size=(args.steps, len(work.train))).astype(np.float32)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, contender in contenders.items():
                results[name].append(timed(contender, work, args.steps, values))
        for name, times in results.items():
            walls = [wall for wall, _ in times]
            median = statistics.median(walls)
            cpu = statistics.median(c for _, c in times)
            print(f"| {work.name} ({len(work.train)}, {work.table_rows}) | "
                  f"{work.step_s * 1e3:.2f} | {name} | {min(walls) * 1e6:.1f} / "
                  f"{median * 1e6:.1f} | {cpu * 1e6:.1f} | {median / work.step_s:.2%} |")


if __name__ == "__main__":
    main()
