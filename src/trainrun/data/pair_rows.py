"""Preference pairs packed into rows: a pair's prompt once, then its chosen and its rejected
sequence side by side after it, so they are in the same batch and the prompt is computed once,
and several short pairs in a row where they fit.

A pair's tokens in a row: the prompt but its last token (the shared prefix), then the last
prompt token and the chosen completion (the chosen branch), then the last prompt token again and
the rejected completion (the rejected branch). Each branch attends to the prefix and to itself
(``models.transformer.SharedPrefixes``), so it computes what the prompt and its completion
alone compute, the last prompt token predicting the completion's first token. A pair takes
``prompt + chosen + rejected + 1`` tokens, against ``2 * prompt + chosen + rejected`` for the
two sequences apart.

A row is ``row_len`` tokens with, beside them:

- ``segment_ids``: each sequence's id, ``2 * slot - 1`` (chosen) and ``2 * slot`` (rejected),
  on its branch; the shared prefix has the chosen one's (0: padding).
- ``positions``: each token's position in its sequence, from 0.
- ``pair_slot``: which of the row's pairs a token belongs to, from 1 (0: padding).
- ``branch``: 0 on the shared prefix, ``CHOSEN`` or ``REJECTED`` on each branch.
- ``answer``: ``CHOSEN`` or ``REJECTED`` on the completion's tokens, 0 on the prompt's.
- ``margin``, only where the pairs carry one (a reward model's records' ``margin`` field): the
  pair's margin as float32 bits in int32 (a precision policy casts floats, not these), on
  every token of the pair.

The targets a pair's log-probability sums are the completion's tokens, each predicted from the
token before it in the same sequence (``models/token_logps.py``'s ``pair_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainrun.data.documents import first_fit
from trainrun.data.preference_pairs import Pair

CHOSEN, REJECTED = 1, 2
ARRAYS = ("tokens", "segment_ids", "positions", "pair_slot", "branch", "answer")
MARGIN = "margin"  # the column of pairs that carry a margin
LAYOUT = "shared-prompt-1"  # in the rows' cache key: rows of another layout are made anew


def pair_length(pair: Pair) -> int:
    """The tokens a pair takes in a row: its prompt, both completions, and the prompt's last
    token again (module docstring)."""
    return pair.prompt.size + pair.chosen.size + pair.rejected.size + min(pair.prompt.size, 1)


def pack_pairs(pairs: Sequence[Pair], row_len: int, bins: int,
               slots: int | None = None) -> tuple[dict[str, np.ndarray], int]:
    """The pairs packed first-fit into rows of ``row_len`` tokens (at most ``bins`` rows open
    at a time) and the most pairs any row holds. ``slots``: refuse rows of more pairs than
    that (ValueError), so every batch's shapes agree with rows packed before. Pairs with a
    margin give the ``margin`` column too (a pair without one: 0)."""
    lengths = [pair_length(pair) for pair in pairs]
    rows = first_fit(lengths, row_len, bins)
    most = max((len(members) for members in rows), default=0)
    if slots is not None and most > slots:
        raise ValueError(f"a row holds {most} pairs, more than the {slots} slots given")
    names = (*ARRAYS, MARGIN) if any(pair.margin is not None for pair in pairs) else ARRAYS
    arrays = {name: np.zeros((len(rows), row_len), np.int32) for name in names}
    for row, members in enumerate(rows):
        at = 0
        for slot, index in enumerate(members, 1):
            at = _place(arrays, row, at, slot, pairs[index])
    return arrays, most


def _place(arrays: dict[str, np.ndarray], row: int, at: int, slot: int, pair: Pair) -> int:
    """Write ``pair`` into ``row`` of ``arrays`` from column ``at`` as slot ``slot``; returns
    the column after it."""
    shared, last = pair.prompt[:-1], pair.prompt[-1:]
    end = at + shared.size
    arrays["tokens"][row, at:end] = shared
    arrays["segment_ids"][row, at:end] = 2 * slot - 1
    arrays["positions"][row, at:end] = np.arange(shared.size)
    arrays["pair_slot"][row, at:end] = slot
    at = end
    for side, answer in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
        end = at + last.size + answer.size
        span = slice(at, end)
        arrays["tokens"][row, span] = np.concatenate([last, answer])
        arrays["segment_ids"][row, span] = 2 * slot - 2 + side
        arrays["positions"][row, span] = shared.size + np.arange(end - at)
        arrays["pair_slot"][row, span] = slot
        arrays["branch"][row, span] = side
        arrays["answer"][row, at + last.size:end] = side
        at = end
    if MARGIN in arrays:
        bits = np.asarray(pair.margin or 0.0, np.float32).view(np.int32)
        arrays[MARGIN][row, at - pair_length(pair):at] = bits
    return at
