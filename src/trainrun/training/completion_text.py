"""A reinforcement-learning run's completions as text: the tokenizer its records are read with,
the ids that end an answer, ``rl.stop_strings``, and each completion's text as the rewards read
it. Made once by the rollout batches (``rollout_batches.py``) and by the scoring of the run's
answers (``held_out_rewards.py``), so training and evaluation end and read answers alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trainrun.config import DataConfig, RLConfig
from trainrun.data import model_tokenizer
from trainrun.data.prompt_records import completion_texts
from trainrun.program.decode import StopStrings


@dataclasses.dataclass(frozen=True)
class CompletionText:
    """tokenizer: the run's records' (``data.tokenizer``, ``data.chat_template``); stops:
    ``rl.stop_strings`` read with it (None: none given)."""

    tokenizer: model_tokenizer.ModelTokenizer
    stops: StopStrings | None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end an answer (the end of a turn, the end of a text)."""
        return self.tokenizer.stop_ids

    def texts(self, ids: Sequence[np.ndarray]) -> list[str]:
        """Completions' texts as the rewards read them (``completion_texts``), each cut at its
        first stop string."""
        return completion_texts(self.tokenizer, ids,
                                self.stops.cut if self.stops is not None else lambda t: t)


def completion_text(data: DataConfig, rl: RLConfig) -> CompletionText:
    """The completion text of a reinforcement-learning run on ``data`` with the ``rl``
    section."""
    tokenizer = model_tokenizer.of_records(data)
    stops = (StopStrings(rl.stop_strings, tokenizer.tokenizer.decode)
             if rl.stop_strings else None)
    return CompletionText(tokenizer, stops)
