"""Data mixtures: the sources interleave as Grain's MapDataset.mix interleaves them, a batch is
a function of its index and the seed (so the position resumes as one index), each source's
share follows its weight, the processes' rows make up the global batch, and ``data.mix``
reaches the run through the config."""

from __future__ import annotations

import grain
import numpy as np
import pytest

from trainrun.config import ConfigError, load_config
from trainrun.data import MixtureBatches, build_dataset, build_eval_dataset
from trainrun.data.mixture import proportions, source_counts


def sources(*sizes: int) -> list[dict[str, np.ndarray]]:
    """Source ``s`` has rows ``[s, j]`` (its index and the row's)."""
    return [{"x": np.stack([np.full(n, s), np.arange(n)], axis=1)} for s, n in enumerate(sizes)]


def test_the_interleaving_is_grains_mix():
    weights = [0.5, 0.2, 0.3]
    parts = [grain.MapDataset.range(10**6).map(lambda j, s=s: (s, j)) for s in range(3)]
    mixed = grain.MapDataset.mix(parts, weights)
    data = MixtureBatches(sources(10**6, 10**6, 10**6), weights, batch_size=7, shuffle=False,
                          seed=0)
    ours = np.concatenate([data[i]["x"] for i in range(40)])
    assert [tuple(row) for row in ours] == [mixed[k] for k in range(40 * 7)]
    counts = source_counts(np.array([280]), proportions(weights))[0]
    assert counts.tolist() == [140, 56, 84] and counts.sum() == 280


def test_a_batch_is_a_function_of_its_index_and_the_seed():
    data = MixtureBatches(sources(50, 9), [3, 1], batch_size=8, shuffle=True, seed=1)
    again = MixtureBatches(sources(50, 9), [3, 1], batch_size=8, shuffle=True, seed=1)
    other = MixtureBatches(sources(50, 9), [3, 1], batch_size=8, shuffle=True, seed=2)
    order = [37, 2, 99, 2, 0]  # out of order and repeated: no hidden iterator state
    assert all(np.array_equal(data[i]["x"], again[i]["x"]) for i in order)
    assert any(not np.array_equal(data[i]["x"], other[i]["x"]) for i in order)
    rows = np.concatenate([data[i]["x"] for i in range(100)])
    share = np.bincount(rows[:, 0]) / len(rows)
    assert share.tolist() == [0.75, 0.25]
    # The small source repeats: each of its epochs shows every row once, in a new order.
    small = rows[rows[:, 0] == 1][:, 1]
    epochs = small[:len(small) // 9 * 9].reshape(-1, 9)
    assert all(sorted(e) == list(range(9)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


def test_the_processes_rows_make_the_global_batch():
    whole = MixtureBatches(sources(40, 40), [1, 2], batch_size=6, shuffle=True, seed=4)
    parts = [MixtureBatches(sources(40, 40), [1, 2], batch_size=6, shuffle=True, seed=4,
                            process_index=p, process_count=3) for p in range(3)]
    for i in (0, 11):
        assert np.array_equal(np.concatenate([p[i]["x"] for p in parts]), whole[i]["x"])


def test_data_mix_through_the_config(tmp_path):
    for name, text in (("a", "alpha = 1\n" * 400), ("b", "beta = 2\n" * 400)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.py").write_text(text)
    mix = f"data.mix=[{{source: '{tmp_path}/a/*.py', weight: 3}}, {{source: '{tmp_path}/b/*.py'}}]"
    config = load_config("lm", [mix, "data.seq_len=16", "model.seq_len=16", "data.batch_size=8"])
    train = build_dataset(config.data, seed=0)
    assert isinstance(train, MixtureBatches) and train.parts == [300, 100]
    windows = [row.tobytes() for i in range(10) for row in train[i]["tokens"]]
    from_a = sum(b"1" in w and b"2" not in w for w in windows)
    from_b = sum(b"2" in w and b"1" not in w for w in windows)
    assert (from_a, from_b) == (60, 20)  # 3 : 1, and no window mixes the two files
    held = build_eval_dataset(config.data, batch_size=2)
    text = held.arrays["tokens"].tobytes()
    assert b"alpha" in text and b"beta" in text  # every source's held-out bytes
    with pytest.raises(ConfigError, match=r"data.paths or data.mix, not both"):
        load_config("lm", [mix, f"data.paths=[{tmp_path}/a/*.py]"])
