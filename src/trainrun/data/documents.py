"""Documents packed into rows of a fixed length, with segment ids and positions.

A document longer than a row is cut into pieces of ``row_len`` tokens that overlap by one: the
last token of a piece (a target) is the first of the next (an input), so every token after the
document token is predicted exactly once, as windows of the byte stream do. A full piece is a
row of its own; the shorter ones (document ends, short documents) are packed first-fit into
rows, with Grain's ``FirstFitPackIterDataset`` rule: ``bins`` rows are open at a time, a piece
goes into the first with room, and a piece that fits none closes them all.

In a row, ``segment_ids`` number its pieces 1, 2, ... (0 is padding) and ``positions`` count
from 0 in each piece. A model attends only within a segment and predicts token ``t + 1`` from
token ``t`` only where both are in the same one, so nothing crosses a document boundary.

Packing happens once, when the data is loaded: the rows are then arrays like any other, and
batch ``i`` of them is a pure function of ``i``, so the stream's position is one index that a
checkpoint saves. (Grain's own packers are iterators, whose position is the packer's buffers.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PACKING_BINS = 64  # rows open at once for the shorter pieces (Grain's num_packing_bins)


def pack_documents(documents: Sequence[np.ndarray], row_len: int,
                   bins: int = PACKING_BINS,
                   masks: Sequence[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """``tokens``, ``segment_ids`` and ``positions``, each ``[rows, row_len]``.

    documents: 1-D token ids, each starting with its document token; fewer than two tokens
        leave nothing to predict and are skipped.
    row_len: tokens per row: ``seq_len + 1`` (the inputs and the last target).
    masks: per document, one boolean per token: whether the loss counts it as a target. Given,
        the rows also hold ``loss_mask`` (uint8), packed as the tokens are.
    Padding is token 0 in segment 0. Full rows come first, in document order, then packed ones.
    """
    if row_len < 2:
        raise ValueError(f"row_len {row_len} leaves nothing to predict; give at least 2")
    dtype = documents[0].dtype if len(documents) else np.uint16
    full, pieces, full_masks, piece_masks = _cut(documents, row_len, masks)
    packed = first_fit([piece.size for piece in pieces], row_len, bins)
    n_full = sum(len(rows) for rows in full)
    index_dtype = row_index_dtype(row_len)
    tokens = np.zeros((n_full + len(packed), row_len), dtype)
    segment_ids = np.zeros(tokens.shape, index_dtype)
    positions = np.zeros(tokens.shape, index_dtype)
    loss_mask = np.zeros(tokens.shape, np.uint8) if masks is not None else None
    if full:
        tokens[:n_full] = np.concatenate(full)
        segment_ids[:n_full] = 1
        positions[:n_full] = np.arange(row_len)
        if loss_mask is not None:
            loss_mask[:n_full] = np.concatenate(full_masks)
    _place_pieces(pieces, piece_masks, packed, n_full, tokens, segment_ids, positions,
                  loss_mask)
    rows = {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}
    if loss_mask is not None:
        rows["loss_mask"] = loss_mask
    return rows


_Pieces = list[np.ndarray]


def _cut(documents: Sequence[np.ndarray], row_len: int, masks: Sequence[np.ndarray] | None,
         ) -> tuple[_Pieces, _Pieces, _Pieces, _Pieces]:
    """Each document of two tokens or more cut into full rows (a ``[count, row_len]`` view per
    document) and the shorter piece left at its end, and their masks cut alike when given:
    ``(full, pieces, full_masks, piece_masks)``."""
    stride = row_len - 1
    full: _Pieces = []
    pieces: _Pieces = []
    full_masks: _Pieces = []
    piece_masks: _Pieces = []
    for n, doc in enumerate(documents):
        if doc.size < 2:
            continue
        mask = None if masks is None else np.asarray(masks[n], np.uint8)
        count, rest = divmod(doc.size - 1, stride)
        if count:
            full.append(np.lib.stride_tricks.sliding_window_view(doc, row_len)[::stride][:count])
            if mask is not None:
                full_masks.append(
                    np.lib.stride_tricks.sliding_window_view(mask, row_len)[::stride][:count])
        if rest:
            pieces.append(doc[count * stride:])
            if mask is not None:
                piece_masks.append(mask[count * stride:])
    return full, pieces, full_masks, piece_masks


def _place_pieces(pieces: _Pieces, piece_masks: _Pieces, packed: list[list[int]], first_row: int,
                  tokens: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray,
                  loss_mask: np.ndarray | None) -> None:
    """Write the pieces into the rows from ``first_row`` on, each row's members (``packed``)
    side by side as segments 1, 2, ..., with their positions and masks."""
    for row, members in enumerate(packed, first_row):
        at = 0
        for segment, i in enumerate(members, 1):
            size = pieces[i].size
            tokens[row, at:at + size] = pieces[i]
            segment_ids[row, at:at + size] = segment
            positions[row, at:at + size] = np.arange(size)
            if loss_mask is not None:
                loss_mask[row, at:at + size] = piece_masks[i]
            at += size


def row_index_dtype(row_len: int) -> type[np.unsignedinteger]:
    """The dtype of ``segment_ids`` and ``positions`` in rows of ``row_len`` tokens."""
    return np.uint16 if row_len <= 2**16 else np.uint32


def first_fit(lengths: Sequence[int], capacity: int, bins: int) -> list[list[int]]:
    """Rows of item indices, in the order rows are closed: each item goes into the first of at
    most ``bins`` open rows with room for it; when none has room and ``bins`` are open, all
    are closed and the item opens a new one."""
    closed: list[list[int]] = []
    rows: list[list[int]] = []
    free: list[int] = []
    for i, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"item {i} of length {length} does not fit a row of {capacity}")
        for row, room in enumerate(free):
            if room >= length:
                rows[row].append(i)
                free[row] -= length
                break
        else:
            if len(rows) == bins:
                closed.extend(rows)
                rows, free = [], []
            rows.append([i])
            free.append(capacity - length)
    return closed + rows
