"""A preference run's batches: the reference log-probabilities computed once in passes of their
own batch size, kept beside the pair rows, read back by the next run, and a damaged file
computed anew."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import counted_calls

from trainrun.config import load_config
from trainrun.models import build_model
from trainrun.models.preference_transformer import REFERENCE_COLUMN
from trainrun.program.precision import Policy
from trainrun.training import preference_data as module
from trainrun.training.preference_data import preference_data

SMALL = ["model.d_model=16", "model.layers=1", "model.heads=2", "data.synthetic_examples=96",
         "data.batch_size=4", "data.eval_fraction=0.125", "preference.reference_batch_size=5"]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.slow
def test_the_reference_is_computed_once_kept_and_a_damaged_file_computed_anew(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config("dpo", SMALL)
    model = build_model(config.model, config.preference)
    params = jax.jit(model.init)(jax.random.key(0))
    compute = module.compute_reference
    computed = counted_calls(monkeypatch, module, "compute_reference")
    first = preference_data(config, Policy(), lambda: params, (0, 1))
    assert len(computed) == 2  # the training rows and the held-out rows
    train = first.train.arrays
    column = train[REFERENCE_COLUMN].view(np.float32)
    # each answer token's log-probability under the start; none elsewhere
    scored = train["answer"] > 0
    assert (column[scored] < 0).all() and (column[train["segment_ids"] == 0] == 0).all()
    # the passes of 5 rows give what one pass over every row gives
    whole = compute(config, Policy(), params, dict(train), len(column))
    np.testing.assert_allclose(column, whole, rtol=1e-6, atol=1e-6)

    again = preference_data(config, Policy(), lambda: params, (0, 1))
    assert len(computed) == 2 and not again.notices  # the next run reads them
    (kept,) = (tmp_path / "cache").glob(f"records/*/reference/*/train.{REFERENCE_COLUMN}.bin")
    expected = np.array(train[REFERENCE_COLUMN])  # a copy: the rows map the file
    data = bytearray(kept.read_bytes())
    data[7] ^= 0x01
    kept.write_bytes(bytes(data))
    damaged = preference_data(config, Policy(), lambda: params, (0, 1))
    assert len(computed) == 3
    assert any("were damaged" in line and "does not match its sha256" in line
               for line in damaged.notices)
    np.testing.assert_array_equal(damaged.train.arrays[REFERENCE_COLUMN], expected)
