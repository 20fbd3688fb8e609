"""Sampled completions of a reinforcement-learning run (``rl.log_completions``, TRL's
``log_completions``): ``count`` completions of the rollout batch of every ``every``-th step,
spread over the batch's prompts, each a line of the run directory's ``completions.jsonl``:

    {"step": 50, "where": "...", "prompt": "...", "completion": "...", "reward": 1.0,
     "rewards": {"exact_match": 1.0}, "advantage": 0.93}

``step`` is the first step that trains on the batch (a resumed run cuts the file back to its
checkpoint, as ``metrics.jsonl``). The rollout batches keep the lines as they draw them; this
hook hands them to the writers at the next read of the metrics, in the metric log's order, so
the file is written where the run's other files are (process 0 alone, a run on object
storage through its stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trainrun.config import RLConfig
from trainrun.data.prompt_records import Prompt
from trainrun.reporting.table import Table
from trainrun.training.hooks import Hook

Record = dict[str, Any]


class CompletionLog(Hook):
    """Keeps sampled completions of the batches that are due (``due``, ``keep``) and writes
    them at each read of the metrics (``on_table``).

    decode: completions' token ids (each cut at its length) -> their texts, as the rewards
    read them; write: the lines to ``completions.jsonl``."""

    every_boundary = False

    def __init__(self, rl: RLConfig, decode: Callable[[list[np.ndarray]], list[str]],
                 write: Callable[[list[Record]], None]):
        self.every, self.count = rl.log_completions.every, rl.log_completions.count
        self.updates, self.group = rl.updates, rl.group
        self.names = [spec.name for spec in rl.rewards]
        self.decode = decode
        self.write = write
        self.kept: list[Record] = []

    def due(self, step: int) -> bool:
        """Whether the batch drawn after ``step`` steps serves an ``every``-th step."""
        return self.every > 0 and (step + self.updates) // self.every > step // self.every

    def rows(self, total: int) -> np.ndarray:
        """The ``count`` rows logged of a batch of ``total``, spread evenly over it."""
        count = min(self.count, total)
        return np.arange(count) * total // count

    def keep(self, step: int, asked: Sequence[Prompt], completions: np.ndarray,
             lengths: np.ndarray, values: np.ndarray, total: np.ndarray,
             advantages: np.ndarray) -> None:
        """The lines of the batch drawn after ``step`` steps: ``asked`` its prompts (one per
        group), ``completions`` ``[rows, limit]`` and their ``lengths``, ``values`` ``[rewards,
        rows]`` each reward, ``total`` their weighted sum, ``advantages`` per row."""
        rows = self.rows(total.size)
        texts = self.decode([completions[row, :lengths[row]] for row in rows])
        for row, text in zip(rows, texts, strict=True):
            prompt = asked[row // self.group]
            self.kept.append({
                "step": step + 1, "where": prompt.where, "prompt": prompt.text,
                "completion": text, "reward": _number(total[row]),
                "rewards": {name: _number(values[i, row]) for i, name in enumerate(self.names)},
                "advantage": _number(advantages[row])})

    def on_table(self, table: Table) -> None:
        if self.kept:
            kept, self.kept = self.kept, []
            self.write(kept)


def _number(value: Any) -> float | None:
    """A float for JSON: a value that is not finite (a reward with nothing to say) is null."""
    number = float(value)
    return number if math.isfinite(number) else None
