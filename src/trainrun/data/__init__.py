"""Data: sources that produce arrays (in memory or memory-mapped) with a train and a held-out
split, and the Grain pipeline that batches them.

The pipeline's names are imported at first use: what reads a tokenizer or a chat template
(``trainrun.load``, ``sample``, ``lm-eval``) does not wait for Grain's import."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainrun.config import DataConfig
from trainrun.data.errors import DataError
from trainrun.platform.lazy_exports import lazy_exports, serve_own_reads

if TYPE_CHECKING:
    from trainrun.data.mixture import MixtureBatches
    from trainrun.data.pipeline import (
        ArrayBatches,
        BatchCursor,
        batch_iterator,
        eval_batches,
        stack_batches,
        token_windows,
    )
    from trainrun.data.record_rows import RecordCounts

_HOME = {
    "ArrayBatches": "trainrun.data.pipeline",
    "BatchCursor": "trainrun.data.pipeline",
    "MixtureBatches": "trainrun.data.mixture",
    "RecordCounts": "trainrun.data.record_rows",
    "batch_iterator": "trainrun.data.pipeline",
    "eval_batches": "trainrun.data.pipeline",
    "stack_batches": "trainrun.data.pipeline",
    "token_windows": "trainrun.data.pipeline",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOME)


Splits = dict[str, Any]  # "train", "eval": arrays or None; a mixture: "train" a list, "weights"


def _splits(cfg: DataConfig) -> Splits:
    """``{"train": arrays, "eval": arrays or None}`` for a data section. The train and eval
    builds of a run share one load: the last section loaded is cached, keyed by its JSON
    (sections with mapping fields are not hashable); files are not re-read for it."""
    return _load(type(cfg), cfg.model_dump_json())


@functools.lru_cache(maxsize=1)
def _load(section: type[DataConfig], blob: str) -> Splits:
    cfg = section.model_validate_json(blob)
    from trainrun.data.digits import digits_arrays
    from trainrun.data.files import array_splits, token_splits
    from trainrun.data.record_rows import record_splits
    from trainrun.data.synthetic import regression_arrays
    from trainrun.data.text import text_splits

    if cfg.kind == "regression":
        return {"train": regression_arrays(cfg), "eval": None}
    sources: dict[str, Callable[[Any], Splits]] = {
        "digits": lambda _: digits_arrays(), "text": text_splits, "arrays": array_splits,
        "tokens": token_splits, "records": record_splits}
    return sources[cfg.kind](cfg)


def data_counts(cfg) -> RecordCounts | None:
    """What became of a record source's records (read, skipped, cut, ...); None for the other
    sources."""
    from trainrun.data.record_rows import RecordCounts

    counts = _splits(cfg).get("counts")
    return counts if isinstance(counts, RecordCounts) else None


def data_files(cfg) -> dict[str, str]:
    """The content fingerprint of each file a data section reads, by its name: the sha256 of
    its bytes (``sha256:<hex>``, hashed where the source reads or keys them), or an object's
    version and size as its store gives them; none for data made in memory or the standard
    library's corpus."""
    return dict(_splits(cfg).get("files", {}))


def data_notices(cfg) -> list[str]:
    """What the console says of a data section's loading (kept record rows found damaged and
    made anew, say): lines; none for most sources."""
    return list(_splits(cfg).get("notices", ()))


def build_dataset(cfg, seed: int, process_index: int = 0,
                  process_count: int = 1) -> ArrayBatches | MixtureBatches:
    """The training dataset a config's ``data`` section names (this process's rows of it): a
    ``MixtureBatches`` of its sources for ``data.mix``."""
    splits = _splits(cfg)
    if isinstance(splits["train"], list):
        return MixtureBatches(splits["train"], splits["weights"], cfg.batch_size,
                              shuffle=cfg.shuffle, seed=seed, process_index=process_index,
                              process_count=process_count)
    return ArrayBatches(splits["train"], cfg.batch_size, shuffle=cfg.shuffle,
                        seed=seed, process_index=process_index, process_count=process_count)


def build_eval_dataset(cfg, batch_size: int | None = None, process_index: int = 0,
                       process_count: int = 1) -> ArrayBatches:
    """The held-out split of ``cfg``, in order, in batches of ``batch_size`` (default: the
    training batch size)."""
    from trainrun.data.pipeline import ArrayBatches

    return ArrayBatches(held_out_arrays(cfg), batch_size or cfg.batch_size, shuffle=False,
                        seed=0, process_index=process_index, process_count=process_count,
                        split="eval")


def held_out_arrays(cfg) -> dict[str, Any]:
    """The arrays of the held-out split of ``cfg``; a DataError naming the fix where it has
    none."""
    arrays = _splits(cfg)["eval"]
    if arrays is None:
        hint = {"arrays": "give data.eval_paths (a .npz or name: .npy mapping)",
                "tokens": "give data.eval_paths (a held-out .bin file)",
                "records": "give data.eval_paths or a data.eval_fraction that leaves at least "
                           "one record out"}.get(
                    cfg.kind, "use data with a held-out split")
        raise DataError(f"data.kind={cfg.kind} has no held-out split to evaluate on; {hint}, "
                        "or set eval.every=0")
    return arrays


__all__ = [
    "ArrayBatches",
    "BatchCursor",
    "DataError",
    "MixtureBatches",
    "RecordCounts",
    "batch_iterator",
    "build_dataset",
    "build_eval_dataset",
    "data_counts",
    "data_files",
    "data_notices",
    "eval_batches",
    "held_out_arrays",
    "stack_batches",
    "token_windows",
]

serve_own_reads(__name__, _HOME)  # after every function above is defined
