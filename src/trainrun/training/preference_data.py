"""A preference run's batches: the pair rows (``data/preference_rows.py``) and, for a loss with
a reference and ``preference.reference: cached``, the reference model's per-token
log-probabilities as one more column, ``reference_logps``.

That column is computed once, before training, from the starting params (the run's fresh init,
or ``init.from``'s), in forward passes of ``preference.reference_batch_size`` rows, by the same
function the step runs (``models/token_logps.py``) under the run's precision. It is
kept beside the rows it scores (``<rows>/reference/<key>-<split>``, as ``storage/kept_files.py``
keeps files), keyed by content: the rows' own key, the sha256 of the starting params' bytes, the
model and the compute dtype; its file's sha256 sits in its manifest and is checked as a run
opens it. A resumed run and the next run on the same data and start read it; a damaged file is
computed anew, with a notice.

The column travels as the float32 values' bits in ``int32``: the step casts floating batch
leaves to the compute dtype, which would round the reference to bfloat16.

A batch is ``data.batch_size`` rows (``eval.batch_size`` held-out rows), each holding as many
whole pairs as fit: the rows keep their packing, so every batch has one shape and a step trains
the pairs of its rows. The run says how many pairs that is on average as it starts, and logs each
step's count (metric ``pairs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import PreferenceConfig, RecordsData, RunConfig
from trainrun.data.errors import DataError
from trainrun.data.pipeline import ArrayBatches
from trainrun.data.preference_rows import PairRows, preference_rows
from trainrun.data.record_rows import RecordCounts
from trainrun.models.preference_losses import REFERENCE_FREE
from trainrun.models.preference_transformer import REFERENCE_COLUMN
from trainrun.models.token_logps import PAIR_ROW_ARRAYS, pair_rows, token_logps
from trainrun.models.transformer import bind_transformer
from trainrun.program.precision import Policy
from trainrun.storage import kept_files

PyTree = Any
CACHE_FORMAT = 2  # raised when the column's layout changes, so old files are not read


@dataclasses.dataclass(frozen=True)
class PreferenceData:
    """What a preference run trains and evaluates on, and what it says of its data."""

    train: ArrayBatches
    eval: dict[str, np.ndarray] | None  # the held-out rows (columns as training's)
    counts: RecordCounts
    files: dict[str, str]  # each file read, by its content fingerprint
    notices: list[str]
    batch_holds: str = ""  # what a training batch holds (``batch_line``), for the console


def cached_reference(preference: PreferenceConfig) -> bool:
    """Whether a preference run's batches carry the cached reference column."""
    return preference.reference == "cached" and preference.loss not in REFERENCE_FREE



def read_pairs(data: RecordsData, section: str, max_prompt: int, max_completion: int,
               margins: bool = False,
               ) -> tuple[PairRows, PairRows | None, dict[str, str], RecordCounts, list[str]]:
    """The pair rows of a run on pairs (``preference_rows``), what became of its records, and
    its notices (a damaged cache made anew, pairs cut to ``section``'s lengths)."""
    train, held, files = preference_rows(data, max_prompt, max_completion, margins)
    counts = RecordCounts(vocab=train.counts.vocab)
    for part in (train, held):
        if part is not None:
            counts.add(part.counts)
    notices = [part.notice for part in (train, held) if part is not None and part.notice]
    cut = train.truncated
    if cut.prompts_cut or cut.completions_cut:
        notices.append(f"preference pairs: {cut.prompts_cut} prompts cut to {section}."
                       f"max_prompt, {cut.completions_cut} pairs' completions cut to "
                       f"{section}.max_completion")
    return train, held, files, counts, notices

def preference_data(config: RunConfig, policy: Policy, start: Callable[[], PyTree],
                    rows: tuple[int, int]) -> PreferenceData:
    """The run's training batches (this process's ``rows``: its index and the count) and its
    held-out rows; ``start``: the starting params, asked for only when the reference column
    is needed."""
    preference = config.tuning(PreferenceConfig)
    data = config.data
    train, held, files, counts, notices = read_pairs(
        data, "preference", preference.max_prompt, preference.max_completion)  # type: ignore[arg-type]
    train_rows, eval_rows = train.train, (held.eval if held is not None else train.eval)
    assert train_rows is not None  # preference_rows refuses a source without
    if cached_reference(preference):
        params = start()
        train_rows = _with_column(config, policy, params, train, "train", train_rows, notices)
        if eval_rows is not None:
            source = held if held is not None else train
            eval_rows = _with_column(config, policy, params, source, "eval", eval_rows, notices)
    batches = pair_batches(train_rows, data.batch_size, shuffle=data.shuffle, seed=config.seed,
                           process_index=rows[0], process_count=rows[1])
    holds = batch_line(data.batch_size, train.counts.examples, batches.num_examples)
    return PreferenceData(train=batches, eval=eval_rows, counts=counts, files=files,
                          notices=notices, batch_holds=holds)


def pair_batches(rows: dict[str, np.ndarray], batch_size: int, split: str = "train",
                 **settings: Any) -> ArrayBatches:
    """``ArrayBatches`` of ``batch_size`` pair rows (``settings``: its own); a batch larger
    than the rows there are is refused in words that say a batch counts rows, not pairs."""
    have = len(rows["tokens"])
    if batch_size > have:
        key = "eval.batch_size" if split == "eval" else "data.batch_size"
        pairs = int(np.asarray(rows["pair_slot"]).max(axis=1).sum())  # a row's slots run 1..n
        raise DataError(f"{key}={batch_size} counts rows of packed pairs, and the {pairs} "
                        f"{'held-out' if split == 'eval' else 'training'} pairs fill {have} "
                        f"row{'s' if have != 1 else ''} of data.seq_len + 1 tokens "
                        f"({pairs / have:.1f} pairs a row); set {key} to {have} or less, or "
                        "add pairs")
    return ArrayBatches(rows, batch_size, split=split, **settings)


def batch_line(batch_size: int, pairs: int, rows: int) -> str:
    """What a training batch holds, for the console: rows, and the pairs they hold on average."""
    per_row = pairs / rows
    return (f"data: a batch is {batch_size} rows (data.batch_size counts rows), each holding as "
            f"many pairs as fit: {pairs} pairs fill {rows} rows, {per_row:.1f} a row, so a step "
            f"trains about {batch_size * per_row:,.0f} pairs (metric pairs: each step's count)")


def _with_column(config: RunConfig, policy: Policy, params: PyTree, rows: PairRows, split: str,
                 arrays: dict[str, np.ndarray], notices: list[str]) -> dict[str, np.ndarray]:
    column = reference_column(config, policy, params, rows.folder, split, arrays, notices)
    return {**arrays, REFERENCE_COLUMN: column.view(np.int32)}


def params_fingerprint(params: PyTree) -> str:
    """The sha256 of the params' bytes, each leaf's path, dtype and shape with them."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        value = np.asarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)} {value.dtype} {value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def reference_column(config: RunConfig, policy: Policy, params: PyTree, rows_folder: Path,
                     split: str, arrays: dict[str, np.ndarray],
                     notices: list[str]) -> np.ndarray:
    """``[rows, row_len]`` float32: the reference log-probability of each token of ``split``'s
    rows (0 at a row's first), kept in the cache, computed first when missing or damaged."""
    preference = config.tuning(PreferenceConfig)
    settings = {"format": CACHE_FORMAT, "rows": rows_folder.name,
                "params": params_fingerprint(params), "model": config.model.model_dump(
                    mode="json"), "compute": config.precision.compute}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    shape = arrays["tokens"].shape

    def read(manifest: dict[str, Any], splits: kept_files.Splits) -> np.ndarray:
        found = splits[split]
        if found is None or found[REFERENCE_COLUMN].shape != shape:
            raise kept_files.Damaged(f"it holds {manifest['rows']} rows, not {shape[0]} of "
                                     f"{shape[1]}")
        return found[REFERENCE_COLUMN]

    def make(folder: Path) -> dict[str, Any]:
        values = compute_reference(config, policy, params, arrays,
                                   preference.reference_batch_size)
        return write_column(folder, split, values)

    column, notice = kept_files.kept(rows_folder / "reference" / f"{key}-{split}",
                                     "reference log-probabilities", (REFERENCE_COLUMN,), read,
                                     make)
    if notice is not None:
        notices.append(notice)
    return column


def write_column(folder: Path, split: str, values: np.ndarray) -> dict[str, Any]:
    """The column's file written into ``folder`` (the kept folder being made); its manifest."""
    files = kept_files.RowFiles(folder, {REFERENCE_COLUMN: "float32"}, values.shape[1])
    files.append(split, {REFERENCE_COLUMN: values})
    return files.manifest()


def compute_reference(config: RunConfig, policy: Policy, params: PyTree,
                      arrays: dict[str, np.ndarray], batch_size: int) -> np.ndarray:
    """The reference column of ``arrays``' rows from ``params``, ``batch_size`` rows per forward
    pass (the last one padded with empty rows)."""
    bind = bind_transformer(config.model)  # type: ignore[arg-type]

    @jax.jit
    def scored(params: PyTree, batch: dict[str, jax.Array]) -> jax.Array:
        logps, _ = token_logps(bind(policy.cast_to_compute(params)), pair_rows(batch),
                               chunk=config.model.loss_chunk)  # type: ignore[union-attr]
        return jnp.pad(logps, ((0, 0), (1, 0)))

    total = arrays["tokens"].shape[0]
    out = np.zeros(arrays["tokens"].shape, np.float32)
    for start in range(0, total, batch_size):
        batch = {name: np.asarray(arrays[name][start:start + batch_size])
                 for name in PAIR_ROW_ARRAYS}
        short = batch_size - batch["tokens"].shape[0]
        if short:  # the one compiled shape: empty rows (segment 0) score nothing
            batch = {name: np.pad(value, ((0, short), (0, 0))) for name, value in batch.items()}
        out[start:start + batch_size] = np.asarray(scored(params, batch))[:batch_size - short]
    return out
