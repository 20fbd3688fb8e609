"""Documents packed into rows: over an epoch every token after a document token is predicted
exactly once (none lost, none twice), pieces never share a segment, positions restart in each
piece, the packer is Grain's first-fit, and tokenized text covers exactly the corpus's bytes
and holds out the very bytes the byte-level data holds out."""

from __future__ import annotations

import grain
import numpy as np
import pytest
from grain.experimental import FirstFitPackIterDataset

from trainrun.config import ConfigError, load_config
from trainrun.data import ArrayBatches, build_dataset, build_eval_dataset
from trainrun.data.documents import first_fit, pack_documents
from trainrun.data.text import corpus_files, split_documents, text_arrays

BOS = 0


def unique_documents(lengths: list[int]) -> list[np.ndarray]:
    """Documents whose tokens are all different (a document token, then fresh ids)."""
    docs, next_id = [], 1
    for length in lengths:
        docs.append(np.array([BOS, *range(next_id, next_id + length - 1)], np.uint32))
        next_id += length - 1
    return docs


def targets_seen(rows: dict[str, np.ndarray]) -> np.ndarray:
    """The tokens that rows predict: targets in the same segment as their input."""
    seg = rows["segment_ids"]
    counted = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    return rows["tokens"][:, 1:][counted]


def test_an_epoch_predicts_every_token_exactly_once():
    rng = np.random.default_rng(0)
    # Short documents, documents of exactly a row, and long ones cut into several pieces.
    lengths = [*rng.integers(2, 40, 60), 33, 34, 65, *rng.integers(40, 300, 20)]
    docs = unique_documents(list(lengths))
    rows = pack_documents(docs, row_len=33, bins=8)
    batches = ArrayBatches(rows, batch_size=1, shuffle=True, seed=5)
    seen = np.concatenate([targets_seen(batches[i])
                           for i in range(batches.batches_per_epoch)])
    expected = np.concatenate([doc[1:] for doc in docs])
    assert seen.size == expected.size  # nothing twice ...
    assert np.array_equal(np.sort(seen), np.sort(expected))  # ... and nothing lost
    # The document token is an input only, never a target.
    assert not np.any(targets_seen(rows) == BOS)


def test_segments_are_pieces_and_positions_restart_in_each():
    docs = unique_documents([5, 3, 70, 4])
    rows = pack_documents(docs, row_len=16, bins=4)
    tokens, seg, pos = rows["tokens"], rows["segment_ids"], rows["positions"]
    assert tokens.shape == seg.shape == pos.shape and tokens.shape[1] == 16
    where_is = {int(t): (d, i) for d, doc in enumerate(docs) for i, t in enumerate(doc) if t}
    starts = []
    for row in range(len(tokens)):
        for s in np.unique(seg[row][seg[row] > 0]):
            where = np.flatnonzero(seg[row] == s)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
            assert np.array_equal(pos[row, where], np.arange(where.size))  # from 0
            piece = tokens[row, where].astype(np.int64)
            # A piece is a run of one document: its start, then consecutive ids.
            assert np.all(np.diff(piece[1:]) == 1)
            doc, at = where_is[int(piece[1])]
            starts.append((doc, at - 1))  # (document, offset of the piece's first token)
        padding = seg[row] == 0
        if padding.any():  # padding only at a row's end, token 0
            assert padding[np.argmax(padding):].all() and not tokens[row, padding].any()
    # The 70-token document: pieces of 16 overlapping by one, each starting 15 tokens on.
    assert sorted(at for doc, at in starts if doc == 2) == [0, 15, 30, 45, 60]
    assert sorted(doc for doc, at in starts if at == 0) == [0, 1, 2, 3]


def test_the_packer_is_grains_first_fit():
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 30, size=200)
    pieces = [{"tokens": np.arange(n, dtype=np.int32) + 1000 * i} for i, n in enumerate(lengths)]
    grain_rows = [row["tokens"] for row in FirstFitPackIterDataset(
        grain.MapDataset.source(pieces).to_iter_dataset(), length_struct={"tokens": 33},
        num_packing_bins=4, shuffle_bins=False)]
    ours = []
    for members in first_fit(list(lengths), 33, bins=4):
        ours.append(np.concatenate([pieces[i]["tokens"] for i in members]))
    assert len(ours) == len(grain_rows)
    for mine, theirs in zip(ours, grain_rows, strict=True):
        assert np.array_equal(theirs[:mine.size], mine) and not theirs[mine.size:].any()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few small text files, one of them with multi-byte characters and one empty."""
    root = tmp_path_factory.mktemp("corpus")
    texts = ["def add(a, b):\n    return a + b\n" * 40, "x = 'naïve café 日本語 🙂'\n" * 30, "",
             "import os\nprint(os.getcwd())\n" * 50, "class A:\n    pass\n" * 60]
    for i, text in enumerate(texts):
        (root / f"f{i}.py").write_text(text, encoding="utf-8")
    return root


def tokenized(corpus, tmp_path, *more: str):
    return load_config("lm_bpe", [f"data.paths=[{corpus}/*.py]",
                                  f"data.tokenizer={tmp_path}/tok.json", "data.vocab_size=300",
                                  "model.vocab=300", "data.seq_len=32", "model.seq_len=32",
                                  "data.batch_size=2", "eval.batch_size=2", *more])


def test_tokenized_rows_cover_every_byte_of_the_text_once(corpus, tmp_path):
    config = tokenized(corpus, tmp_path, "data.eval_fraction=0.2")
    train = build_dataset(config.data, seed=0)
    held = build_eval_dataset(config.data)
    train_docs, held_docs = split_documents([f"{corpus}/*.py"], 0.2)
    for dataset, docs in ((train, train_docs), (held, held_docs)):
        rows = dataset.arrays
        seg = rows["segment_ids"]
        counted = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
        covered = int(rows["token_bytes"][:, 1:][counted].sum())
        # Every byte of the split, once (the text is valid UTF-8, so its bytes are the file's).
        assert covered == sum(len(doc) for doc in docs)
    assert (tmp_path / "tok.json").is_file()  # trained at first use, beside the data's config


def test_documents_hold_out_the_bytes_the_byte_stream_holds_out(corpus):
    patterns = [f"{corpus}/*.py"]
    train, held = split_documents(patterns, 0.3)
    config = load_config("lm", [f"data.paths=[{corpus}/*.py]", "data.eval_fraction=0.3",
                                "data.seq_len=8", "model.seq_len=8"])
    stream = b"".join(path.read_bytes() for path in corpus_files(patterns))
    assert b"".join(train) + b"".join(held) == stream
    windows = text_arrays(config.data)["eval"]["tokens"]
    held_stream = b"".join(held)
    assert bytes(windows[0].tobytes()) == held_stream[:9]  # the byte data's first window
    assert all(doc for doc in train + held)  # the empty file is no document


def test_vocabularies_that_do_not_fit_are_refused_on_one_line():
    with pytest.raises(ConfigError, match=r"model\.vocab=1000 is smaller than .*vocab_size=4096"):
        load_config("lm_bpe", ["model.vocab=1000"])
    with pytest.raises(ConfigError, match="below 257"):
        load_config("lm_bpe", ["data.vocab_size=200", "model.vocab=200"])
    assert load_config("lm_bpe").model.vocab == load_config("lm_bpe").data.vocab_size
