"""A weighted mixture of row sources as one random-access dataset of batches.

The mixed stream of rows interleaves the sources in proportion to their weights exactly as
Grain's ``MapDataset.mix`` does (the same integer proportions and the same count of each source
among the first ``k`` rows; tested against it), with no randomness: row ``k`` of the stream is
row ``j`` of source ``s``, both computed from ``k`` alone. Source ``s``'s own stream runs
through its rows epoch after epoch, each epoch under the permutation ``default_rng((seed, s,
epoch))``. Global batch ``i`` is stream rows ``i * batch_size ...``: a pure function of ``i``
and the seed, so the position of a run is one index, as for ``ArrayBatches``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import grain
import numpy as np

from trainrun.data.errors import DataError
from trainrun.data.pipeline import process_rows

Arrays = Mapping[str, np.ndarray]


def proportions(weights: Sequence[float]) -> list[int]:
    """Integer proportions from float weights, as Grain makes them (the smallest becomes
    100)."""
    scale = 100 / min(weights)
    return [int(weight * scale) for weight in weights]


def source_counts(k: np.ndarray, parts: Sequence[int]) -> np.ndarray:
    """``[len(k), sources]``: how many of the first ``k`` rows of the mixed stream come from
    each source (Grain's interleaving: each source in turn takes its share of what the sources
    before it left)."""
    k = np.asarray(k, np.int64)
    counts = np.zeros((k.size, len(parts)), np.int64)
    remaining = sum(parts)
    current = k.copy()
    for s, part in enumerate(parts):
        rest = current * (remaining - part) // remaining
        counts[:, s] = current - rest
        remaining -= part
        current = rest
    return counts


class MixtureBatches(grain.MapDataset):
    """Global batch ``i`` (this process's rows of it) of a weighted mixture of sources.

    sources: per source, arrays with its rows on axis 0; every source has the same arrays with
        the same row shapes and dtypes (``tokens``, ``segment_ids``, ...).
    weights: each source's relative share of the rows (> 0).
    batch_size, shuffle, seed, process_index, process_count: as for ``ArrayBatches``.
    """

    def __init__(self, sources: Sequence[Arrays], weights: Sequence[float], batch_size: int, *,
                 shuffle: bool, seed: int, process_index: int = 0, process_count: int = 1):
        super().__init__()
        if len(sources) != len(weights) or not sources:
            raise DataError(f"{len(sources)} sources but {len(weights)} weights; give one "
                            "weight per source")
        shapes = [{name: (a.shape[1:], a.dtype) for name, a in arrays.items()}
                  for arrays in sources]
        if any(shape != shapes[0] for shape in shapes):
            raise DataError("the sources of data.mix give rows of different shapes; every "
                            "source must be the same kind of data")
        self.sources = [dict(arrays) for arrays in sources]
        self.sizes = [len(next(iter(arrays.values()))) for arrays in sources]
        empty = [s for s, size in enumerate(self.sizes) if size == 0]
        if empty:
            raise DataError(f"data.mix source {empty[0]} has no training rows; give it more "
                            "text or leave it out")
        if batch_size % process_count:
            raise DataError(f"batch_size {batch_size} does not divide over {process_count} "
                            "processes; make it a multiple of the process count")
        self.parts = proportions(weights)
        self.batch_size = batch_size
        # Not self.shuffle / self.seed: those would hide Grain's MapDataset methods.
        self.shuffled = shuffle
        self.shuffle_seed = seed
        self.rows = process_rows(batch_size, process_index, process_count)

    def __len__(self) -> int:
        return 2**40  # unbounded for any real run; each source repeats by itself

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one dataset per run; a few epochs' orders)
    def _order(self, source: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng((self.shuffle_seed, source, epoch))
        return rng.permutation(self.sizes[source])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        start = index * self.batch_size
        counts = source_counts(np.arange(start, start + self.batch_size + 1), self.parts)
        taken = np.diff(counts, axis=0)[self.rows]  # one 1 per row: its source
        which = np.argmax(taken, axis=1)
        within = counts[:-1][self.rows][np.arange(len(which)), which]  # index in that source
        out = {name: np.empty((len(which), *a.shape[1:]), a.dtype)
               for name, a in self.sources[0].items()}
        for s in np.unique(which):
            mine = which == s
            epoch, position = np.divmod(within[mine], self.sizes[s])
            rows = position.copy()
            if self.shuffled:
                for e in np.unique(epoch):
                    rows[epoch == e] = self._order(int(s), int(e))[position[epoch == e]]
            for name, a in self.sources[s].items():
                out[name][mine] = a[rows]
        return out
