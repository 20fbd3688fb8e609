"""The fan-out: a run's metric rows to every sink, its log steps to the console, its timing
windows to ``timing.jsonl``, a reinforcement-learning run's sampled completions to
``completions.jsonl``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from trainrun import rundir
from trainrun.reporting.console import Console, ConsoleLog
from trainrun.reporting.sinks.jsonl import JsonlWriter
from trainrun.reporting.sinks.tensorboard import TENSORBOARD_DIR, TensorBoardWriter
from trainrun.reporting.sinks.wandb import WandbWriter
from trainrun.reporting.sinks.writer import Writer
from trainrun.reporting.table import Table


class RunOutput:
    """Everything a run writes about its metrics: the writers, the console (``console.py``),
    timing windows.

    Rows come in windows (the loop's reads, or one at a time from a metrics stream on another
    thread): each goes to every writer, and log steps also to the console. A lock keeps rows
    from two threads whole.
    """

    def __init__(self, writers: list[Writer], console: Console,
                 log_every: int, total_steps: int, timing: JsonlWriter | None = None,
                 start_step: int = 0, completions: JsonlWriter | None = None):
        self.writers = writers
        self.console = console
        self.log_every = log_every
        self.total = total_steps
        self.timing = timing
        self.completions = completions
        self.lock = threading.Lock()
        self.last_log = (start_step, time.perf_counter())

    def write_table(self, table: Table, steps_per_s: float | None = None,
                    note: str = "") -> None:
        """A table of training steps to every writer, and its log steps to the console.
        steps_per_s: the rate its log lines show (the step compute of the window read; else
        the wall clock since the previous line). note: added to its log lines."""
        with self.lock:
            for writer in self.writers:
                writer.write_table(table)
            first_log = -(-table.first // self.log_every) * self.log_every
            log_steps = list(range(first_log, table.last + 1, self.log_every))
            if table.first <= self.total <= table.last and self.total not in log_steps:
                log_steps.append(self.total)
            for step in log_steps:
                self._log_line(step, table.row(step - table.first), steps_per_s, note)

    def _log_line(self, step: int, metrics: Mapping[str, float], rate: float | None = None,
                  note: str = "") -> None:
        now = time.perf_counter()
        if rate is None:
            rate = (step - self.last_log[0]) / max(now - self.last_log[1], 1e-9)
        self.last_log = (step, now)
        self.console.line(step, metrics, rate, note)

    def reset_rate(self, step: int) -> None:
        """The console's next rate counts from here (after a compile, which is not a step)."""
        with self.lock:
            self.last_log = (step, time.perf_counter())

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        """One row to every writer (eval rows: the console line is the caller's)."""
        with self.lock:
            for writer in self.writers:
                writer.write(step, metrics, split)

    def write_window(self, step: int, steps: int, step_s: float, examples_per_step: int) -> None:
        """One timing window (``timing.jsonl`` and the ``perf/`` charts): its last step, its
        step count and its device time per step."""
        perf = {"step_time_s": step_s, "steps_per_s": 1.0 / step_s if step_s else 0.0,
                "examples_per_s": examples_per_step / step_s if step_s else 0.0,
                "window_steps": float(steps)}
        with self.lock:
            if self.timing is not None:
                self.timing.write(step, perf)
            for writer in self.writers:
                if not isinstance(writer, JsonlWriter):
                    writer.write(step, perf, "perf")

    def write_completions(self, records: list[dict[str, Any]]) -> None:
        """Sampled completions to ``completions.jsonl`` (none where it is not written: a
        process other than 0, or a run that logs none)."""
        with self.lock:
            if self.completions is not None:
                for record in records:
                    self.completions.write_record(record)

    def message(self, text: str) -> None:
        with self.lock:
            self.console.message(text)

    def flush(self) -> None:
        """Rows written so far reach the files (before a checkpoint: they survive a kill)."""
        with self.lock:
            for writer in [*self.writers, self.timing, self.completions]:
                if writer is not None:
                    writer.flush()

    def close(self) -> None:
        with self.lock:
            for writer in self.writers:
                writer.close()
            for jsonl in (self.timing, self.completions):
                if jsonl is not None:
                    jsonl.close()
            self.writers, self.timing, self.completions = [], None, None
            self.console.close()


def build_output(run_dir: Path, console: Console, *, log_every: int,
                 total_steps: int, primary: bool, start_step: int = 0, tensorboard: bool = True,
                 wandb: Literal["off", "offline", "online"] = "off",
                 wandb_project: str = "trainrun",
                 config: dict[str, Any] | None = None, name: str = "run",
                 completions: bool = False) -> RunOutput:
    """A run's ``RunOutput`` around its ``console`` (made earlier, for start-up messages).
    ``primary`` is process 0: the others write no files and print no lines (they would repeat
    process 0's). completions: the run writes ``completions.jsonl``."""
    if not primary:
        silent = ConsoleLog(total_steps, 1, open(os.devnull, "w"))  # noqa: SIM115
        return RunOutput([], silent, log_every, total_steps, start_step=start_step)
    console.start_at(start_step)
    writers: list[Writer] = [JsonlWriter(run_dir / rundir.METRICS)]
    if tensorboard:
        writers.append(TensorBoardWriter(run_dir / TENSORBOARD_DIR, start_step))
    if wandb != "off":
        writers.append(WandbWriter(run_dir, config or {}, name, wandb, wandb_project,
                                   log_every, total_steps))
    return RunOutput(writers, console, log_every, total_steps,
                     JsonlWriter(run_dir / rundir.TIMING), start_step,
                     JsonlWriter(run_dir / rundir.COMPLETIONS) if completions else None)
