"""What a run prints while it trains: a rich progress bar on a terminal (step/total, loss, lr,
a reinforcement-learning run's mean reward, examples or tokens per second, ETA), plain log lines
anywhere else (CI, a file), never a redraw there. Both take the loop's log points and messages
through the same methods. The steps/s shown is the step compute of the window a line closes
(``timing.StepTimer``), with the parts of its steps made on the host (a reinforcement-learning
run's rollouts)."""

from __future__ import annotations

import atexit
import sys
from collections.abc import Mapping
from typing import TextIO

from rich.console import Console as RichConsole
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from trainrun.errors import printable


class ConsoleLog:
    """Plain log lines every ``metrics.every`` steps: step, loss, lr, the mean reward where there
    is one, steps/s, examples/s. Used when the output is not a terminal (CI, a file): one line
    per log point, never a redraw."""

    def __init__(self, total_steps: int, examples_per_step: int, out: TextIO | None = None,
                 unit: str = "examples"):
        self.total = total_steps
        self.examples_per_step = examples_per_step
        self.out = sys.stdout if out is None else out  # the stdout of now, not of the import
        self.unit = unit

    def line(self, step: int, metrics: Mapping[str, float], steps_per_s: float,
             note: str = "") -> None:
        width = len(str(self.total))
        self.out.write(
            f"step {step:>{width}}/{self.total}  loss {metrics['loss']:.6g}  "
            f"lr {metrics['lr']:.3g}  {_reward(metrics)}{steps_per_s:,.1f} steps/s  "
            f"{steps_per_s * self.examples_per_step:,.0f} {self.unit}/s{note}\n")
        self.out.flush()

    def message(self, text: str) -> None:
        self.out.write(_lines(text) + "\n")
        self.out.flush()

    def start_at(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleProgress:
    """A rich progress bar on a terminal: step/total, loss, lr, throughput, ETA. Redrawn only
    when a log point's metrics arrive (no refresh thread taking the interpreter from the loop);
    messages print above it."""

    def __init__(self, total_steps: int, examples_per_step: int, out: TextIO,
                 unit: str = "examples"):
        self.examples_per_step = examples_per_step
        self.unit = unit
        self.progress = Progress(
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"), BarColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[rate]}"),
            TextColumn("ETA"), TimeRemainingColumn(),
            console=RichConsole(file=out), auto_refresh=False, redirect_stdout=False,
            redirect_stderr=False)
        self.task = self.progress.add_task("train", total=total_steps, loss="-", lr="-",
                                           rate="")
        self.progress.start()
        atexit.register(self.progress.stop)  # a run that raised still gives the cursor back

    def line(self, step: int, metrics: Mapping[str, float], steps_per_s: float,
             note: str = "") -> None:
        rate = (f"{_reward(metrics)}{steps_per_s * self.examples_per_step:,.0f} "
                f"{self.unit}/s{note}")
        self.progress.update(self.task, completed=step, loss=f"{metrics['loss']:.5g}",
                             lr=f"{metrics['lr']:.3g}", rate=rate)
        self.progress.refresh()

    def message(self, text: str) -> None:
        self.progress.console.print(_lines(text), markup=False, highlight=False,
                                    soft_wrap=True)

    def start_at(self, step: int) -> None:
        """A resumed run: the bar and its rate start from ``step``."""
        self.progress.reset(self.task, completed=step)

    def close(self) -> None:
        self.progress.stop()


Console = ConsoleLog | ConsoleProgress


def make_console(total_steps: int, examples_per_step: int, out: TextIO,
                 unit: str = "examples") -> Console:
    """A progress bar when ``out`` is a terminal, plain lines otherwise."""
    if RichConsole(file=out).is_terminal:
        return ConsoleProgress(total_steps, examples_per_step, out, unit)
    return ConsoleLog(total_steps, examples_per_step, out, unit)


def _reward(metrics: Mapping[str, float]) -> str:
    """A reinforcement-learning run's mean reward, as the line shows it ("" where none)."""
    return f"reward {metrics['reward']:.4g}  " if "reward" in metrics else ""


def _lines(text: str) -> str:
    """``text``'s lines, each with its control characters escaped (a run name or path in a
    message cannot drive the terminal)."""
    return "\n".join(printable(line) for line in text.split("\n"))
