"""The data pipeline: sources, per-process shards, epochs, and an iterator position that
restores to exactly the batches an uninterrupted iterator gives."""

from __future__ import annotations

import hashlib
import io
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from trainrun.config import ArrayData, DigitsData, RecordsData, TextData, TokenData, load_config
from trainrun.data import (
    ArrayBatches,
    BatchCursor,
    DataError,
    batch_iterator,
    build_dataset,
    build_eval_dataset,
    data_files,
    stack_batches,
    token_windows,
)
from trainrun.data.text import corpus_files, stdlib_patterns
from trainrun.training.loop import run


def ids_dataset(n: int = 50, batch: int = 8, **kw) -> ArrayBatches:
    """Examples that carry their own index, so coverage and order can be checked exactly."""
    arrays = {"id": np.arange(n), "x": np.arange(n * 3, dtype=np.float32).reshape(n, 3)}
    return ArrayBatches(arrays, batch, shuffle=True, seed=7, **kw)


@pytest.mark.parametrize("threads", [0, 2])
def test_iterator_position_restores_the_same_batches(threads):
    """Across an epoch boundary too: 50 examples, batches of 8 -> 6 batches an epoch."""
    reference = batch_iterator(ids_dataset(), threads)
    expected = [next(reference)["id"] for _ in range(20)]

    first = batch_iterator(ids_dataset(), threads)
    for _ in range(9):
        next(first)
    saved = first.get_state()
    resumed = batch_iterator(ids_dataset(), threads)  # a new process would build it anew
    resumed.set_state(saved)
    got = [next(resumed)["id"] for _ in range(11)]
    assert all(np.array_equal(a, b) for a, b in zip(expected[9:], got, strict=True))


def test_prefetching_changes_no_batch():
    plain, threaded = batch_iterator(ids_dataset(), 0), batch_iterator(ids_dataset(), 3)
    for _ in range(15):
        a, b = next(plain), next(threaded)
        assert np.array_equal(a["id"], b["id"]) and np.array_equal(a["x"], b["x"])


def test_each_epoch_is_a_new_permutation_of_whole_batches():
    data = ids_dataset()
    epochs = [np.concatenate([data[e * 6 + i]["id"] for i in range(6)]) for e in range(3)]
    for ids in epochs:  # 48 distinct examples per epoch; the last 2 wait for another order
        assert len(set(ids.tolist())) == 48
    assert not np.array_equal(epochs[0], epochs[1])
    assert np.array_equal(epochs[1], np.concatenate([ids_dataset()[6 + i]["id"]
                                                     for i in range(6)]))  # from the seed


@pytest.mark.parametrize("shuffle", [True, False])
def test_two_processes_read_disjoint_halves_that_make_the_global_batch(shuffle, tmp_path):
    arrays = {"id": np.arange(64)}
    whole = ArrayBatches(arrays, 16, shuffle=shuffle, seed=3)
    parts = [ArrayBatches(arrays, 16, shuffle=shuffle, seed=3, process_index=i,
                          process_count=2) for i in range(2)]
    for index in (0, 3, 4, 9):  # within and across epochs
        halves = [p[index]["id"] for p in parts]
        assert not set(halves[0].tolist()) & set(halves[1].tolist())
        assert np.array_equal(np.concatenate(halves), whole[index]["id"])

    tokens = tmp_path / "t.bin"
    np.arange(5000, dtype=np.uint16).tofile(tokens)
    cfg = TokenData(paths=str(tokens), seq_len=16, batch_size=8)
    whole = build_dataset(cfg, seed=1)
    halves = [build_dataset(cfg, seed=1, process_index=i, process_count=2)[5]["tokens"]
              for i in range(2)]
    assert np.array_equal(np.concatenate(halves), whole[5]["tokens"])
    assert halves[0].shape == (4, 17)


@pytest.mark.parametrize("shuffle", [True, False])
def test_k_batches_in_one_gather_are_the_k_batches_read_one_by_one(shuffle, tmp_path):
    tokens = tmp_path / "t.bin"
    np.arange(3000, dtype=np.uint16).tofile(tokens)
    memmapped = build_dataset(TokenData(paths=str(tokens), seq_len=16, batch_size=8,
                                        shuffle=shuffle), seed=2, process_index=1,
                              process_count=2)
    n = 50
    in_memory = ArrayBatches({"id": np.arange(n), "x": np.arange(n * 3.0).reshape(n, 3)}, 8,
                             shuffle=shuffle, seed=7)
    for data in (in_memory, memmapped):
        cursor, one_by_one = BatchCursor(data), BatchCursor(data)
        assert cursor.stacked is not None  # the gather is what is tested, not the fallback
        for k in (1, 4, 13, 7):  # 6 batches an epoch: calls within and across epochs
            got, want = cursor.take(k), stack_batches([next(one_by_one) for _ in range(k)])
            assert got.keys() == want.keys()
            for name in want:
                assert got[name].dtype == want[name].dtype
                assert got[name].shape == want[name].shape and got[name].shape[0] == k
                assert got[name].tobytes() == want[name].tobytes()
                assert type(got[name]) is np.ndarray  # read from the file here, not later
        assert cursor.get_state() == one_by_one.get_state() == {"next_index": 25}


def test_a_subclass_reading_its_own_batches_is_read_through_its_getitem():
    class Doubled(ArrayBatches):
        def __getitem__(self, index):
            return {k: 2 * v for k, v in super().__getitem__(index).items()}

    arrays = {"id": np.arange(40)}
    plain = ArrayBatches(arrays, 4, shuffle=True, seed=0)
    cursor = BatchCursor(Doubled(arrays, 4, shuffle=True, seed=0))
    assert cursor.stacked is None
    got = cursor.take(3)["id"]
    assert np.array_equal(got, 2 * np.stack([plain[i]["id"] for i in range(3)]))


def test_a_sparse_datasets_gaps_are_skipped_as_grains_iterator_skips_them():
    """A filtered MapDataset holds None where an element was filtered out: the cursor reads
    past it as Grain's own iterator does, and their positions agree."""
    import grain

    source = grain.MapDataset.source([{"id": np.array([i])} for i in range(12)])
    sparse = source.filter(lambda b: b["id"][0] % 3 != 1)  # None at 1, 4, 7, 10
    grains = batch_iterator(sparse, 2)
    expected = [next(grains)["id"] for _ in range(5)]
    cursor = BatchCursor(sparse)
    got = [next(cursor)["id"] for _ in range(2)]
    assert cursor.get_state() == {"next_index": 3}
    got += list(cursor.take(3)["id"])
    assert all(np.array_equal(a, b) for a, b in zip(expected, got, strict=True))
    assert cursor.get_state() == grains.get_state() == {"next_index": 7}


def test_token_file_windows_are_consecutive_spans(tmp_path):
    path = tmp_path / "train.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)  # nanoGPT's format: raw uint16
    data = build_dataset(TokenData(paths=str(path), seq_len=10, batch_size=4, shuffle=False),
                         seed=0)
    batch = data[2]["tokens"]
    assert batch.dtype == np.uint16 and batch.shape == (4, 11)
    assert np.array_equal(batch[0], np.arange(80, 91))  # window 8 starts at token 80
    assert np.array_equal(batch[1], np.arange(90, 101))  # and shares its last with the next
    assert isinstance(batch, np.ndarray) and not isinstance(batch, np.memmap)
    windows = token_windows(np.arange(25), 8, "x")
    assert windows.shape == (3, 9) and windows[-1, -1] == 24


def test_text_corpus_by_glob_holds_out_its_tail(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.py").write_bytes(b"x = 1\n" * 200)
    (tmp_path / "two.py").write_bytes(b"y = 2\n" * 100)
    (tmp_path / "skip.txt").write_bytes(b"not matched")
    cfg = TextData(paths=(str(tmp_path / "**" / "*.py"),), seq_len=16, batch_size=4,
                   eval_fraction=0.1, shuffle=False)
    train, held = build_dataset(cfg, seed=0), build_eval_dataset(cfg)
    corpus = b"x = 1\n" * 200 + b"y = 2\n" * 100  # sorted paths: a/one.py, then two.py
    assert train[0]["tokens"].dtype == np.uint8
    assert bytes(train[0]["tokens"][0]) == corpus[:17]
    tail = corpus[len(corpus) - len(corpus) // 10:]
    assert bytes(held[0]["tokens"][0]) == tail[:17]


@pytest.mark.slow
def test_default_corpus_is_this_pythons_standard_library():
    files = corpus_files(stdlib_patterns())
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py") in files
    data = build_dataset(TextData(seq_len=64, batch_size=8, shuffle=False), seed=0)
    assert data.num_examples > 100_000  # tens of MB of source
    first = files[0].read_bytes() + files[1].read_bytes()
    assert bytes(data[0]["tokens"][0]) == first[:65]


def test_digits_split_is_fixed_and_complete():
    train = build_dataset(DigitsData(batch_size=1437, shuffle=False), seed=0)[0]
    test = build_eval_dataset(DigitsData(), batch_size=360)[0]
    assert train["x"].shape == (1437, 8, 8, 1) and test["x"].shape == (360, 8, 8, 1)
    assert train["x"].min() >= 0.0 and train["x"].max() <= 1.0
    assert set(test["label"].tolist()) == set(range(10))
    again = build_eval_dataset(DigitsData(batch_size=32), batch_size=360)[0]
    assert np.array_equal(test["label"], again["label"])  # the same split every time


def test_npy_and_npz_arrays_load(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((20, 3), np.float32))
    np.save(tmp_path / "y.npy", np.arange(20, dtype=np.float32)[:, None])
    np.savez(tmp_path / "eval.npz", x=np.zeros((6, 3), np.float32),
             y=np.zeros((6, 1), np.float32))
    cfg = ArrayData(paths={"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")},
                    eval_paths=str(tmp_path / "eval.npz"), batch_size=5, shuffle=False)
    batch = build_dataset(cfg, seed=0)[1]
    assert np.array_equal(batch["y"][:, 0], np.arange(5, 10))
    assert build_eval_dataset(cfg, batch_size=3)[1]["x"].shape == (3, 3)


def _fails_with(tmp_path, overrides: list[str], *words: str) -> None:
    run_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    with pytest.raises(DataError) as err:
        run(load_config("digits", overrides), run_dir, out=io.StringIO())
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    assert not (run_dir / "metrics.jsonl").exists()  # refused before anything was written


def test_every_data_file_read_is_fingerprinted_by_its_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))

    def write(name: str, blob: bytes) -> str:
        (tmp_path / name).write_bytes(blob)
        return str(tmp_path / name)

    def sha(*paths: str) -> dict[str, str]:
        return {p: "sha256:" + hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}

    a, b = write("a.txt", b"x" * 300), write("b.txt", b"y" * 300)
    assert data_files(TextData(paths=(str(tmp_path / "*.txt"),), seq_len=16)) == sha(a, b)
    mixed = TextData(mix=({"source": a}, {"source": b}), seq_len=16)
    assert data_files(mixed) == sha(a, b)
    train, held = (write(f"{n}.bin", np.arange(400, dtype=np.uint16).tobytes())
                   for n in ("train", "val"))
    assert data_files(TokenData(paths=train, eval_paths=held, seq_len=16)) == sha(train, held)
    np.save(tmp_path / "x.npy", np.ones((40, 2), np.float32))
    np.savez(tmp_path / "held.npz", x=np.ones((8, 2), np.float32))
    arrays = ArrayData(paths={"x": str(tmp_path / "x.npy")}, eval_paths=str(tmp_path / "held.npz"))
    assert data_files(arrays) == sha(str(tmp_path / "x.npy"), str(tmp_path / "held.npz"))
    assert data_files(DigitsData()) == {}


def test_record_files_read_are_fingerprinted_by_their_bytes(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")  # records are tokenized (the records extra)
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    records, held_out = (tmp_path / "r.jsonl", tmp_path / "h.jsonl")
    for path in (records, held_out):
        path.write_text(json.dumps({"text": path.stem * 40}) + "\n")
    cfg = RecordsData(paths=(str(records),), eval_paths=(str(held_out),), seq_len=64,
                      batch_size=1)
    assert data_files(cfg) == {str(p): "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
                               for p in (records, held_out)}


def test_bad_data_errors_name_the_problem(tmp_path):
    # missing files
    _fails_with(tmp_path, ["data.kind=arrays", f"data.paths={tmp_path}/nope.npz"],
                "nope.npz", "not found")
    # batch larger than the data
    _fails_with(tmp_path, ["data.batch_size=5000"], "5000", "1437", "data.batch_size")
    # arrays of mismatched length
    np.savez(tmp_path / "bad.npz", x=np.zeros((10, 8, 8, 1)), label=np.zeros(9, np.int32))
    _fails_with(tmp_path, ["data.kind=arrays", f"data.paths={tmp_path}/bad.npz"],
                "different lengths", "'x': 10", "'label': 9")


def test_empty_and_missing_corpora_are_errors(tmp_path):
    (tmp_path / "empty.py").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        build_dataset(TextData(paths=(str(tmp_path / "*.py"),)), seed=0)
    with pytest.raises(DataError, match="matches no files"):
        build_dataset(TextData(paths=(str(tmp_path / "none" / "*.py"),)), seed=0)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        build_dataset(TokenData(paths=str(tmp_path / "empty.bin")), seed=0)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="whole number of uint16"):
        build_dataset(TokenData(paths=str(tmp_path / "odd.bin")), seed=0)
    (tmp_path / "short.py").write_bytes(b"x = 1\n")
    with pytest.raises(DataError, match="fewer than one window"):
        build_dataset(TextData(paths=(str(tmp_path / "short.py"),), seq_len=64), seed=0)


@pytest.mark.slow
def test_a_data_error_exits_2_with_one_line(tmp_path, cli):
    result = cli("train", "--config", "digits", "--run-dir", str(tmp_path / "r"),
                 "data.kind=tokens", f"data.paths={tmp_path}/missing.bin")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.paths")
    assert "missing.bin" in lines[0] and "not found" in lines[0]


@pytest.mark.parametrize("kind", ["arrays", "mixture"])
def test_grains_own_shuffle_and_seed_work_on_what_trainrun_returns(kind):
    import grain

    from trainrun.data.mixture import MixtureBatches

    x = np.arange(64, dtype=np.float32).reshape(32, 2)
    data: grain.MapDataset = (
        ArrayBatches({"x": x}, 4, shuffle=True, seed=3) if kind == "arrays"
        else MixtureBatches([{"x": x}, {"x": -x}], [1, 1], batch_size=4, shuffle=True, seed=3))
    assert callable(data.shuffle) and callable(data.seed)
    window = data[:8]  # a finite stretch of the unbounded batches, as Grain slices it
    shuffled = window.shuffle(seed=5)
    batches = [window[i]["x"].tobytes() for i in range(8)]
    reordered = [shuffled[i]["x"].tobytes() for i in range(8)]
    assert sorted(reordered) == sorted(batches) and reordered != batches
    seeded = window.seed(5).shuffle()
    assert sorted(seeded[i]["x"].tobytes() for i in range(8)) == sorted(batches)
