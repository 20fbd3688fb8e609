"""Callbacks: stop early on an eval metric, keep the best checkpoint, log metrics your own way.

    python examples/callbacks.py [RUN_DIR]

Trains the digits CNN with an evaluation every 50 steps. ``EarlyStopping`` ends the run once
eval accuracy has not improved for 3 evaluations (the run then saves its final checkpoint and
finishes), ``checkpoint.keep_best`` keeps the checkpoint with the lowest eval loss beside the
latest one, and a ``MetricLogger`` writes every row to a CSV file of its own. A callback of your
own subclasses ``trainrun.Callback`` and overrides ``at_boundary`` (see ``PrintBest``).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import trainrun


class PrintBest(trainrun.Callback):
    """A callback of one's own: prints each new best eval accuracy with its step. It needs no
    boundary of its own (evaluations are boundaries anyway), so calls between them run back to
    back."""

    every_boundary = False

    def __init__(self) -> None:
        self.best = 0.0

    def at_boundary(self, boundary: trainrun.Boundary) -> None:
        if boundary.eval is not None and boundary.eval["accuracy"] > self.best:
            self.best = boundary.eval["accuracy"]
            print(f"new best eval accuracy {self.best:.4f} at step {boundary.step}")


class CsvRows:
    """``write(step, split, metrics)`` for a MetricLogger: rows of a CSV file in the run
    directory, opened at the first row (the run creates its directory)."""

    def __init__(self, path: Path):
        self.path, self.file = path, None

    def __call__(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if self.file is None:
            self.file = self.path.open("w", newline="")
            self.rows = csv.writer(self.file)
            self.rows.writerow(["step", "split", *metrics])
        self.rows.writerow([step, split, *metrics.values()])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def main(run_dir: str = "runs/callbacks") -> trainrun.RunSummary:
    config = trainrun.load_config("digits", [
        "name=callbacks", "steps=400", "eval.every=50", "metrics.every=100",
        "checkpoint.keep=1", "checkpoint.keep_best=eval/loss",
    ])
    csv_rows = CsvRows(Path(run_dir) / "metrics.csv")
    callbacks = [
        trainrun.EarlyStopping("eval/accuracy", patience=3, mode="max"),
        trainrun.MetricLogger(csv_rows, names=["loss"]),
        PrintBest(),
    ]
    try:
        summary = trainrun.run(config, run_dir, callbacks=callbacks)
    finally:
        csv_rows.close()
    print(f"best checkpoint: {summary.best_checkpoint}")
    return summary


if __name__ == "__main__":
    main(*sys.argv[1:])
