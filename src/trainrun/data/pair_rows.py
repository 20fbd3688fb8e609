"""Preference pairs packed into rows: a pair's chosen and rejected sequence (each its prompt,
then its completion) always side by side in one row, so they are in the same batch, and
several short pairs in a row where they fit.

A row is ``row_len`` tokens with, beside them:

- ``segment_ids``: 1, 2, ... per sequence in the row (0: padding); attention stays inside one.
- ``positions``: each sequence's own, from 0.
- ``pair_slot``: which of the row's pairs a token belongs to, from 1 (0: padding).
- ``answer``: ``CHOSEN`` or ``REJECTED`` on the completion's tokens, 0 on the prompt's.

The targets a pair's log-probability sums are the completion's tokens, each predicted from the
token before it in the same sequence (``program``'s ``pair_logps``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainrun.data.documents import first_fit
from trainrun.data.preference_pairs import Pair

CHOSEN, REJECTED = 1, 2
ARRAYS = ("tokens", "segment_ids", "positions", "pair_slot", "answer")


def pair_length(pair: Pair) -> int:
    """The tokens a pair takes in a row: its prompt twice and both completions."""
    return 2 * pair.prompt.size + pair.chosen.size + pair.rejected.size


def pack_pairs(pairs: Sequence[Pair], row_len: int, bins: int,
               slots: int | None = None) -> tuple[dict[str, np.ndarray], int]:
    """The pairs packed first-fit into rows of ``row_len`` tokens (at most ``bins`` rows open
    at a time) and the most pairs any row holds. ``slots``: refuse rows of more pairs than
    that (ValueError), so every batch's shapes agree with rows packed before."""
    lengths = [pair_length(pair) for pair in pairs]
    rows = first_fit(lengths, row_len, bins)
    most = max((len(members) for members in rows), default=0)
    if slots is not None and most > slots:
        raise ValueError(f"a row holds {most} pairs, more than the {slots} slots given")
    arrays = {name: np.zeros((len(rows), row_len), np.int32) for name in ARRAYS}
    for row, members in enumerate(rows):
        at = 0
        for slot, index in enumerate(members, 1):
            pair = pairs[index]
            for side, answer in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
                end = at + pair.prompt.size + answer.size
                span = slice(at, end)
                arrays["tokens"][row, span] = np.concatenate([pair.prompt, answer])
                arrays["segment_ids"][row, span] = 2 * slot - 2 + side
                arrays["positions"][row, span] = np.arange(end - at)
                arrays["pair_slot"][row, span] = slot
                arrays["answer"][row, at + pair.prompt.size:end] = side
                at = end
    return arrays, most
