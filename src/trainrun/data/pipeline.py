"""The Grain pipeline: a random-access dataset of whole batches over in-memory arrays.

Element ``i`` of the dataset is global batch ``i``: epoch ``i // batches_per_epoch`` under that
epoch's permutation, and of it only this process's rows. Because a batch is a pure function of
its index, the iterator's whole position is Grain's ``next_index``: saving it with a checkpoint
and restoring it gives exactly the batches an uninterrupted run would have seen.

Gathering a batch with one fancy-index per array (rather than Grain's per-record batching) keeps
the host cost of a step small beside a small model's short step (BENCHMARKS.md, "Data pipeline").
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Mapping
from typing import Any, overload

import grain
import jax
import numpy as np

from trainrun.data.errors import DataError

Batch = dict[str, np.ndarray]


def process_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of a global batch of ``batch_size`` that process ``process_index`` of
    ``process_count`` holds (a multiple of the count: each holds as many)."""
    local = batch_size // process_count
    return slice(process_index * local, (process_index + 1) * local)


class ArrayBatches(grain.MapDataset[Batch]):
    """Global batch ``i`` (this process's rows of it) over arrays of equal length.

    arrays: name -> array with the examples on axis 0 (in memory, memory-mapped, or a window
        view from ``token_windows``).
    batch_size: the global batch; each of ``process_count`` processes gets an equal slice.
    shuffle: permute examples each epoch with ``default_rng((seed, epoch))``; else file order.
    split: named in error messages ("train", "eval").
    Incomplete final batches of an epoch are dropped, so every step sees a full batch.
    A batch is always a fresh in-memory array or a view of one: reading from a file happens
    where the batch is loaded (a prefetch thread), not later in the training loop.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, *, shuffle: bool,
                 seed: int, process_index: int = 0, process_count: int = 1,
                 split: str = "train"):
        super().__init__()
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"{split} data arrays have different lengths {lengths}; every "
                            "array needs one entry per example")
        self.num_examples = next(iter(lengths.values()))
        if batch_size > self.num_examples:
            key = "eval.batch_size" if split == "eval" else "data.batch_size"
            raise DataError(f"batch size {batch_size} is larger than the {split} data "
                            f"({self.num_examples} examples); lower {key} or add data")
        if batch_size % process_count:
            raise DataError(f"batch_size {batch_size} does not divide over {process_count} "
                            "processes; make it a multiple of the process count")
        self.arrays = dict(arrays)
        self.copy = {name: _needs_copy(a) for name, a in self.arrays.items()}
        self.batch_size = batch_size
        # Not self.shuffle / self.seed: those would hide Grain's MapDataset methods.
        self.shuffled = shuffle
        self.shuffle_seed = seed
        self.batches_per_epoch = self.num_examples // batch_size
        self.rows = process_rows(batch_size, process_index, process_count)

    def __len__(self) -> int:
        return self.batches_per_epoch * 2**40  # unbounded for any real run; epochs repeat

    @functools.lru_cache(maxsize=2)  # noqa: B019 (one dataset per run; holds two epochs' orders)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.shuffle_seed, epoch)).permutation(self.num_examples)

    def _order(self, epoch: int) -> np.ndarray | None:
        return self._permutation(epoch) if self.shuffled else None

    @overload
    def __getitem__(self, index: slice) -> grain.MapDataset[Batch]: ...

    @overload
    def __getitem__(self, index: int) -> Batch: ...

    def __getitem__(self, index: int | slice) -> Batch | grain.MapDataset[Batch]:
        if isinstance(index, slice):
            return self.slice(index)
        epoch, position = divmod(index, self.batches_per_epoch)
        start = position * self.batch_size
        order = self._order(epoch)
        if order is None:
            rows = slice(start + self.rows.start, start + self.rows.stop)
            return {name: np.array(a[rows]) if self.copy[name] else a[rows]
                    for name, a in self.arrays.items()}
        idx = order[start:start + self.batch_size][self.rows]
        return {name: _gather(a, idx) for name, a in self.arrays.items()}

    def stacked(self, start: int, k: int) -> Batch:
        """Batches ``start .. start + k - 1`` stacked ``[k, rows, ...]``: what
        ``stack_batches`` of them gives, with one gather per array."""
        epochs, positions = np.divmod(np.arange(start, start + k), self.batches_per_epoch)
        idx = (positions[:, None] * self.batch_size
               + np.arange(self.rows.start, self.rows.stop)[None, :])
        if self.shuffled:
            for epoch in np.unique(epochs).tolist():
                in_epoch = epochs == epoch
                idx[in_epoch] = self._permutation(epoch)[idx[in_epoch]]
        return {name: _gather(a, idx) for name, a in self.arrays.items()}


def _gather(array: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``array[idx]`` (rows of axis 0) as a plain in-memory array. ``np.take`` gathers whole
    rows, far faster than ``array[idx]`` on many short rows (the default MLP's batches)."""
    return np.asarray(np.take(array, idx, axis=0))


def _needs_copy(array: np.ndarray) -> bool:
    """Whether a slice of ``array`` would be a lazy or strided view (of a file mapping, or of
    overlapping windows) rather than plain contiguous memory."""
    base: object = array  # then its .base, which may be a non-array buffer (an mmap)
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return not array.flags.c_contiguous


def token_windows(stream: np.ndarray, seq_len: int, what: str,
                  strict: bool = True) -> np.ndarray:
    """A 1-D token stream as windows ``[N, seq_len + 1]``; window ``i`` starts at token
    ``i * seq_len``, so consecutive windows share one token (a target becomes the next input).
    A strided view: nothing is copied until a batch gathers its windows.

    strict: a stream shorter than one window is an error (else: zero windows).
    """
    if stream.size < seq_len + 1:
        if strict:
            raise DataError(f"{what} has {stream.size} tokens, fewer than one window of "
                            f"seq_len + 1 = {seq_len + 1}; lower data.seq_len or add data")
        return np.zeros((0, seq_len + 1), stream.dtype)
    view = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)
    return view[::seq_len]


def eval_batches(dataset: ArrayBatches, max_batches: int = 0) -> list[int]:
    """Indices of the batches one evaluation reads: the first epoch in order, at most
    ``max_batches`` of them (0: all)."""
    count = dataset.batches_per_epoch
    return list(range(min(count, max_batches) if max_batches else count))


class BatchCursor:
    """Reads a MapDataset of batches in order, in the caller's thread.

    Grain's own iterator spends a noticeable share of a small model's step on its bookkeeping;
    reading element ``i`` directly costs a fraction of that. The position is kept in Grain's
    state format (``{"next_index": i}``), so a checkpoint written through either iterator
    restores into the other.
    """

    def __init__(self, dataset: grain.MapDataset):
        self.dataset = dataset
        self.next_index = 0
        # K batches in one gather, unless a subclass reads its batches its own way
        self.stacked = (dataset.stacked if isinstance(dataset, ArrayBatches)
                        and type(dataset).__getitem__ is ArrayBatches.__getitem__ else None)

    def __iter__(self) -> BatchCursor:
        return self

    def __next__(self) -> Any:  # a batch: a dict of arrays, or any tree a user's dataset holds
        batch = None
        while batch is None:  # None: a sparse dataset's gap (a filter's), skipped as Grain does
            index = self.next_index
            self.next_index = index + 1
            batch = self.dataset[index]
        return batch

    def take(self, k: int) -> Any:
        """The next ``k`` batches, stacked ``[k, ...]``."""
        start = self.next_index
        if self.stacked is not None:
            batch, end = self.stacked(start, k), start + k
        else:
            batches: list[Any] = []
            end = start
            while len(batches) < k:
                read = self.dataset[end]
                end += 1
                if read is not None:  # a sparse dataset's gap, as in __next__
                    batches.append(read)
            batch = stack_batches(batches)
        self.next_index = end  # moved only once the batches are read
        return batch

    def skip(self, k: int) -> None:
        """Move on ``k`` batches without reading them (a call cut them on the device:
        ``resident.py``)."""
        self.next_index += k

    def get_state(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def set_state(self, state: Mapping[str, int]) -> None:
        self.next_index = int(state["next_index"])


def stack_batches(batches: list[Any]) -> Any:
    """K host batches -> one batch whose leaves are ``[K, ...]`` (a single host copy). A dict
    of arrays (every built-in source) is stacked directly: ``jax.tree.map`` over K trees cost
    more than the copy on the default MLP."""
    first = batches[0]
    if type(first) is dict and all(isinstance(v, np.ndarray) for v in first.values()):
        return {name: np.stack([b[name] for b in batches]) for name in first}
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


def batch_iterator(dataset: grain.MapDataset,
                   prefetch_threads: int = 0) -> grain.DatasetIterator | BatchCursor:
    """A checkpointable iterator (``get_state``/``set_state``) over ``dataset``.

    prefetch_threads > 0: Grain's iterator loads batches ahead on that many threads,
    overlapping host work (reading, decoding) with device compute. 0: a ``BatchCursor`` in the
    caller's thread, best when a batch is a cheap slice of arrays already in memory.
    """
    if prefetch_threads == 0:
        return BatchCursor(dataset)
    options = grain.ReadOptions(num_threads=prefetch_threads,
                                prefetch_buffer_size=2 * prefetch_threads)
    return iter(dataset.to_iter_dataset(options))
