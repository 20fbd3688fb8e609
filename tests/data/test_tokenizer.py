"""Tokenizers: trained at first use and written where data.tokenizer points, read back by the
next run, the same from the same text; each token's byte count is exact, so token counts add
up to the text's bytes; encoded corpora are reused from the cache (an unreadable entry is
encoded again); bad or missing tokenizers,
and a missing tokenizers package, stop the run on one line."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from trainrun.data import DataError
from trainrun.data import tokenizer as tk

TEXTS = ["def f(x):\n    return x * 2\n" * 20, "s = 'naïve café 日本語 🙂 \\x00'\n" * 10,
         "for i in range(10):\n    print(i)\n" * 20]


def test_trained_at_first_use_then_read_back(tmp_path):
    path = tmp_path / "sub" / "tok.json"
    calls = []

    def texts():
        calls.append(1)
        return TEXTS

    first = tk.load_or_train(str(path), texts, 300)
    again = tk.load_or_train(str(path), texts, 300)
    assert path.is_file() and len(calls) == 1  # trained once, then read from the file
    assert again.to_str() == first.to_str()
    assert tk.train(TEXTS, 300).to_str() == first.to_str()  # the same text, the same tokenizer
    assert first.get_vocab_size() <= 300 and first.token_to_id(tk.DOCUMENT_TOKEN) is not None


def test_token_bytes_add_up_to_the_texts_bytes(tmp_path):
    tokenizer = tk.load_or_train(str(tmp_path / "tok.json"), lambda: TEXTS, 300)
    table = tk.token_bytes(tokenizer)
    assert table[tokenizer.token_to_id(tk.DOCUMENT_TOKEN)] == 0
    unseen = "λ = lambda ü: ü  # ☃ not in the training text\n"
    for text in [*TEXTS, unseen]:
        ids = tokenizer.encode(text).ids
        assert int(table[ids].sum()) == len(text.encode())
    docs = tk.encode(tokenizer, [unseen, "x"])
    assert [int(d[0]) for d in docs] == [tokenizer.token_to_id(tk.DOCUMENT_TOKEN)] * 2
    assert docs[0].dtype == np.uint16 and tokenizer.decode(docs[0][1:].tolist()) == unseen


def test_encoded_texts_are_read_back_from_the_cache(tmp_path, monkeypatch):
    tokenizer = tk.load_or_train(str(tmp_path / "tok.json"), lambda: TEXTS, 300)
    cache = tmp_path / "tok.json.cache"
    first = tk.encode(tokenizer, TEXTS, cache)
    assert len(list(cache.glob("*.npz"))) == 1

    class NoEncoding:  # the same tokenizer, but encoding fails: only the cache can answer
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name.startswith("encode"):
                raise AssertionError("encoded again")
            return getattr(self.inner, name)

    again = tk.encode(NoEncoding(tokenizer), TEXTS, cache)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert len(tk.encode(tokenizer, TEXTS[:1], cache)) == 1  # other texts: a new entry
    for entry in cache.glob("*.npz"):
        entry.write_bytes(b"half a file")  # an unreadable entry is encoded again
    assert all(np.array_equal(a, b) for a, b in zip(first, tk.encode(tokenizer, TEXTS, cache),
                                                    strict=True))


def test_bad_tokenizers_are_refused_on_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"cannot read .* as a tokenizer\.json"):
        tk.load_or_train(str(bad), lambda: TEXTS, 300)
    big = tmp_path / "big.json"
    big.write_text(tk.train(TEXTS, 300).to_str())
    with pytest.raises(DataError, match=r"more than data\.vocab_size=280.*at least"):
        tk.load_or_train(str(big), lambda: TEXTS, 280)
    with pytest.raises(DataError, match="is a folder"):
        tk.load_or_train(str(tmp_path), lambda: TEXTS, 300)
    import tokenizers

    plain = tokenizers.Tokenizer(tokenizers.models.BPE())
    plain.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    plain.train_from_iterator(TEXTS, tokenizers.trainers.BpeTrainer(vocab_size=280,
                                                                    show_progress=False))
    (tmp_path / "plain.json").write_text(plain.to_str())
    with pytest.raises(DataError, match="no <\\|endoftext\\|> token"):
        tk.load_or_train(str(tmp_path / "plain.json"), lambda: TEXTS, 300)


def test_without_the_package_the_error_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(DataError, match=r"pip install .trainrun\[text\]."):
        tk.load_or_train(str(tmp_path / "tok.json"), lambda: TEXTS, 300)
