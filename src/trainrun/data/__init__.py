"""Data: sources that produce in-memory arrays, and the Grain pipeline that batches them."""

from __future__ import annotations

from trainrun.data.pipeline import ArrayBatches, DataError, batch_iterator


def build_dataset(cfg, seed: int, process_index: int = 0,
                  process_count: int = 1) -> ArrayBatches:
    """The training dataset a config's ``data`` section names (this process's rows of it)."""
    from trainrun.data.synthetic import regression_arrays

    sources = {"regression": regression_arrays}
    arrays = sources[cfg.kind](cfg)
    return ArrayBatches(arrays, cfg.batch_size, shuffle=cfg.shuffle, seed=seed,
                        process_index=process_index, process_count=process_count)


__all__ = ["ArrayBatches", "DataError", "batch_iterator", "build_dataset"]
