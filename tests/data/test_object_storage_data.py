"""Data on object storage: text, tokenized text and records (JSONL, gzipped JSONL, Parquet) read
from ``gs://`` and ``s3://`` buckets (both emulators) give exactly the rows of the same files on
disk; globs are matched by the store's listing; an object rewritten gets new rows; what is not
there is one line; records are streamed by ranged reads, nothing copied to disk, and no folder
named ``gs:`` or ``s3:`` is ever made."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_records import chat, llama3_tokenizer_dir, segments, write_jsonl

from trainrun.config import RecordsData, TextData
from trainrun.data import DataError, build_dataset, build_eval_dataset
from trainrun.data.record_rows import record_splits
from trainrun.data.text import corpus_files, text_splits
from trainrun.storage import location, remote

TEXTS = {"a.txt": "def add(a, b):\n    return a + b\n" * 30,
         "b.txt": "the quick brown fox jumps over the lazy dog\n" * 25,
         "sub/c.txt": "import os\nprint(os.getcwd())\n" * 20,
         "notes.md": "# not text the globs take\n" * 10}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Kept rows in the test's folder, which is also where a folder named gs: or s3: would be
    made (the working directory)."""
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    yield
    made = [p for p in tmp_path.rglob("*") if p.name in ("gs:", "s3:")]
    assert made == []


def upload(local: Path, url: str) -> str:
    location.location(url).write_bytes(local.read_bytes())
    return url


def corpus(tmp_path: Path, bucket: str) -> Path:
    """``TEXTS`` in ``tmp_path/corpus`` and under ``<bucket>/corpus/``."""
    root = tmp_path / "corpus"
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        upload(root / name, f"{bucket}/corpus/{name}")
    return root


def assert_same_arrays(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


def test_text_in_a_bucket_gives_the_windows_and_packed_rows_of_the_same_files_on_disk(
        bucket, tmp_path):
    root = corpus(tmp_path, bucket)
    assert [str(f) for f in corpus_files([f"{bucket}/corpus/**/*.txt"])] == [
        f"{bucket}/corpus/a.txt", f"{bucket}/corpus/b.txt", f"{bucket}/corpus/sub/c.txt"]
    for pattern in ("*.txt", "**/*.txt"):
        local = text_splits(TextData(paths=(str(root / pattern),), seq_len=16))
        here = text_splits(TextData(paths=(f"{bucket}/corpus/{pattern}",), seq_len=16))
        for split in ("train", "eval"):
            assert_same_arrays(here[split], local[split])
    # Tokenized: a tokenizer.json in the bucket, trained on first use and written there, gives
    # the rows a local copy of it gives the local files.
    tokenizer = f"{bucket}/tokenizers/text.json"
    settings = dict(seq_len=16, vocab_size=300, eval_fraction=0.2)
    here = text_splits(TextData(paths=(f"{bucket}/corpus/**/*.txt",), tokenizer=tokenizer,
                                **settings))
    (tmp_path / "text.json").write_bytes(location.location(tokenizer).read_bytes())
    local = text_splits(TextData(paths=(str(root / "**/*.txt"),),
                                 tokenizer=str(tmp_path / "text.json"), **settings))
    for split in ("train", "eval"):
        assert_same_arrays(here[split], local[split])
    assert list((tmp_path / "cache").glob("encoded-text/*.npz"))  # encoded ids kept locally


def test_a_mixture_of_text_sources_in_a_bucket_gives_the_local_batches(bucket, tmp_path):
    root = corpus(tmp_path, bucket)

    def batches(prefix: str) -> list[dict]:
        cfg = TextData(mix=({"source": [f"{prefix}/a.txt", f"{prefix}/b.txt"], "weight": 3.0},
                            {"source": f"{prefix}/sub/*.txt"}), seq_len=16, batch_size=4)
        dataset = build_dataset(cfg, seed=0)
        return [dataset[i] for i in range(3)]

    for here, local in zip(batches(f"{bucket}/corpus"), batches(str(root)), strict=True):
        assert_same_arrays(here, local)


def records_files(tmp_path: Path, bucket: str, records: list[dict]) -> dict[str, tuple]:
    """``records`` as JSONL, gzipped JSONL and Parquet, on disk and in the bucket:
    name -> (local path, URL)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root = tmp_path / "records"
    root.mkdir()
    files = {"chat.jsonl": write_jsonl(root / "chat.jsonl", records),
             "chat.jsonl.gz": write_jsonl(root / "chat.jsonl.gz", records)}
    pq.write_table(pa.Table.from_pylist(records), root / "chat.parquet", row_group_size=7)
    files["chat.parquet"] = root / "chat.parquet"
    return {name: (str(path), upload(path, f"{bucket}/records/{name}"))
            for name, path in files.items()}


def records(**settings) -> RecordsData:
    return RecordsData(**{"seq_len": 64, "batch_size": 4, "eval_fraction": 0.0, **settings})


def test_records_in_a_bucket_give_the_rows_of_the_same_files_on_disk(bucket, tmp_path,
                                                                     monkeypatch):
    files = records_files(tmp_path, bucket, [chat(i) for i in range(40)])
    held = write_jsonl(tmp_path / "held.jsonl", [chat(100 + i) for i in range(6)])
    held_url = upload(held, f"{bucket}/held/held.jsonl")
    ranges: list[int] = []
    read_range = remote.ObjectLocation.read_range

    def spy(path, start: int, end: int) -> bytes:
        ranges.append(end - start)
        return read_range(path, start, end)

    monkeypatch.setattr(remote.ObjectLocation, "read_range", spy)
    monkeypatch.setattr(remote.ObjectLocation, "read_bytes",
                        lambda path: pytest.fail(f"{path} read whole"))
    for name, (local, url) in files.items():
        here = record_splits(records(paths=(url,), eval_paths=(held_url,)))
        there = record_splits(records(paths=(local,), eval_paths=(str(held),)))
        assert len(segments(here["train"])) == 40 and len(segments(here["eval"])) == 6, name
        for split in ("train", "eval"):
            assert_same_arrays(here[split], there[split])
    assert ranges and max(ranges) <= remote.READ_BLOCK  # streamed: block by block
    # A mixture of the three by glob, with every 4th record held out: the local batches.
    mixed = [{"source": "records/*.jsonl*", "weight": 2.0}, {"source": "records/*.parquet"}]
    local_mix = [{**m, "source": str(tmp_path / m["source"])} for m in mixed]
    here_cfg = records(mix=tuple({**m, "source": f"{bucket}/{m['source']}"} for m in mixed),
                       eval_fraction=0.25)
    there_cfg = records(mix=tuple(local_mix), eval_fraction=0.25)
    here_data, there_data = build_dataset(here_cfg, seed=1), build_dataset(there_cfg, seed=1)
    for i in range(4):
        assert_same_arrays(here_data[i], there_data[i])
    assert_same_arrays(build_eval_dataset(here_cfg)[0], build_eval_dataset(there_cfg)[0])


def test_an_object_rewritten_in_place_gives_its_new_rows_and_fingerprint(bucket, tmp_path):
    url = upload(write_jsonl(tmp_path / "old.jsonl", [chat(i) for i in range(10, 30)]),
                 f"{bucket}/chat.jsonl")
    cfg = records(paths=(url,))
    first = record_splits(cfg)
    old = segments(first["train"])
    new = write_jsonl(tmp_path / "new.jsonl", [chat(i) for i in range(50, 70)])  # same size
    upload(new, url)
    again = record_splits(cfg)
    rows = segments(again["train"])
    assert rows == segments(record_splits(records(paths=(str(new),)))["train"])
    assert rows != old
    # what a resume compares with the run's record: another fingerprint, so it is refused
    assert list(first["files"]) == list(again["files"]) == [url]
    assert first["files"][url] != again["files"][url]


def test_a_model_directorys_tokenizer_in_a_bucket_encodes_as_from_disk(bucket, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = llama3_tokenizer_dir(tmp_path / "model", transformers)
    for file in model.iterdir():
        upload(file, f"{bucket}/model/{file.name}")
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(12)])
    here = record_splits(records(paths=(str(path),), tokenizer=f"{bucket}/model"))
    there = record_splits(records(paths=(str(path),), tokenizer=str(model)))
    assert_same_arrays(here["train"], there["train"])
    # and its tokenizer.json alone, as a file
    alone = [record_splits(records(paths=(str(path),), chat_template="chatml", seq_len=256,
                                   tokenizer=tokenizer))["train"]
             for tokenizer in (f"{bucket}/model/tokenizer.json", str(model / "tokenizer.json"))]
    assert_same_arrays(*alone)


@pytest.mark.parametrize("what, paths, says", [
    ("no match for a glob", "{bucket}/corpus/*.jsonl", r"pattern '.*/corpus/\*\.jsonl' "
     r"matches no objects; check the bucket and the path"),
    ("a missing object", "{bucket}/corpus/missing.jsonl",
     r"data\.paths: no object .*/corpus/missing\.jsonl; check the bucket and the path"),
    ("no bucket", "{scheme}://no-such-bucket-here/x/*.jsonl",
     r"bucket 'no-such-bucket-here' does not exist"),
])
def test_what_is_not_there_is_one_line(bucket, tmp_path, what, paths, says):
    corpus(tmp_path, bucket)
    scheme = remote.scheme_of(bucket)
    for cfg in (records(paths=(paths.format(bucket=bucket, scheme=scheme),)),
                TextData(paths=(paths.format(bucket=bucket, scheme=scheme),))):
        with pytest.raises((DataError, remote.StorageRefused), match=says) as err:
            (record_splits if isinstance(cfg, RecordsData) else text_splits)(cfg)
        assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"data\.tokenizer: no object or folder .*/nothing; "
                       "give a Hugging Face model directory") as err:
        record_splits(records(paths=(f"{bucket}/corpus/a.txt",), tokenizer=f"{bucket}/nothing"))


def test_no_credentials_for_s3_is_one_line(object_store_servers, tmp_path, monkeypatch):
    """gcsfs falls back to anonymous access when it finds no credentials (the store then says
    what it allows); s3fs refuses to send a request without them."""
    s3fs = pytest.importorskip("s3fs")
    bucket = object_store_servers["s3"].new_bucket()
    url = upload(write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(4)]),
                 f"{bucket}/chat.jsonl")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(remote.StorageRefused, match=r"^no credentials for s3://.*: give "
                           "them through AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") as err:
            record_splits(records(paths=(url,)))
        assert "\n" not in str(err.value)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
