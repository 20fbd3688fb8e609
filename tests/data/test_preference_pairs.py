"""Preference records in TRL's three forms, encoded as prompt, chosen and rejected token ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from trainrun.data import model_tokenizer
from trainrun.data.preference_pairs import (
    Pair,
    PairCounts,
    detect_form,
    encode_pairs,
    problem,
    split,
)


@pytest.fixture(scope="module")
def chatml() -> model_tokenizer.ModelTokenizer:
    return model_tokenizer.load("bytes", chat_template="chatml")


def _text(tokenizer: model_tokenizer.ModelTokenizer, ids: np.ndarray) -> str:
    return str(tokenizer.tokenizer.decode(ids.tolist(), skip_special_tokens=False))


def _one(tokenizer: model_tokenizer.ModelTokenizer, record: dict[str, Any],
         max_prompt: int = 0, max_completion: int = 0) -> tuple[Pair, PairCounts]:
    form = detect_form(record)
    assert form is not None and problem(record, form) is None
    counts = PairCounts()
    (pair,) = encode_pairs([record], form, tokenizer, max_prompt, max_completion, counts)
    assert isinstance(pair, Pair)
    return pair, counts


def test_standard_pairs_end_each_completion_with_eos(chatml: model_tokenizer.ModelTokenizer
                                                     ) -> None:
    pair, counts = _one(chatml, {"prompt": "2+2=", "chosen": "4", "rejected": "5"})
    prompt = chatml.tokenizer.encode("2+2=", add_special_tokens=True).ids
    assert pair.prompt.tolist() == prompt
    assert pair.chosen.tolist() == [*chatml.tokenizer.encode("4", add_special_tokens=False).ids,
                                    chatml.eos_id]
    assert _text(chatml, pair.rejected).startswith("5")
    assert (counts.records, counts.pairs) == (1, 1)


def test_conversational_pairs_split_at_the_generation_prompt(
        chatml: model_tokenizer.ModelTokenizer) -> None:
    question = [{"role": "user", "content": "Capital of France?"}]
    record = {"prompt": question, "chosen": [{"role": "assistant", "content": "Paris"}],
              "rejected": [{"role": "assistant", "content": "Lyon"}]}
    pair, _ = _one(chatml, record)
    assert _text(chatml, pair.prompt) == (
        "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert _text(chatml, pair.chosen) == "Paris<|im_end|>"  # the end of turn, not the newline
    assert _text(chatml, pair.rejected) == "Lyon<|im_end|>"
    # the same pair written with an implicit prompt encodes the same
    implicit = {"chosen": question + record["chosen"], "rejected": question + record["rejected"]}
    assert detect_form(implicit) == "implicit"
    again, _ = _one(chatml, implicit)
    for a, b in zip((pair.prompt, pair.chosen, pair.rejected),
                    (again.prompt, again.chosen, again.rejected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_implicit_texts_split_as_trl_extracts_the_prompt() -> None:
    record = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    assert split(record, "implicit") == ("The sky is", " blue.", " green.")
    whole = {"chosen": "Answer: yes", "rejected": "Answer: no"}
    assert split(whole, "implicit") == ("Answer:", " yes", " no")


def test_truncation_keeps_the_prompt_end_and_the_answer_start(
        chatml: model_tokenizer.ModelTokenizer) -> None:
    pair, counts = _one(chatml, {"prompt": "abcdefgh", "chosen": "0123456789", "rejected": "xy"},
                        max_prompt=3, max_completion=4)
    assert _text(chatml, pair.prompt) == "fgh"
    assert _text(chatml, pair.chosen) == "0123"
    assert _text(chatml, pair.rejected).startswith("xy") and pair.rejected.size == 3
    assert (counts.prompts_cut, counts.completions_cut) == (1, 1)


@pytest.mark.parametrize("record,words", [
    ({"prompt": "q", "chosen": "a"}, None),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' is"),
    ({"prompt": [{"role": "user", "content": "q"}],
      "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "role is not 'assistant'"),
    ({"chosen": "yes", "rejected": "no"}, "share no prompt"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "no message after"),
    ({"prompt": "q", "chosen": [], "rejected": "b"}, "'chosen' is"),
])
def test_bad_records_are_described(record: dict[str, Any], words: str | None) -> None:
    form = detect_form(record)
    if words is None:
        assert form is None
        return
    assert form is not None
    found = problem(record, form)
    assert found is not None and words in found


def test_answers_that_are_the_same_tokens_are_described_not_encoded(
        chatml: model_tokenizer.ModelTokenizer) -> None:
    question = [{"role": "user", "content": "q"}]
    same = "'chosen' and 'rejected' are the same tokens"
    cases = [  # (record, max_completion, what it encodes to)
        ({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, 0, None),
        ({"prompt": "2+2=", "chosen": "4", "rejected": "4"}, 0, same + ": "),
        ({"prompt": "2+2=", "chosen": "", "rejected": ""}, 0, same + ": "),  # <eos> alone
        ({"prompt": "2+2=", "chosen": "four", "rejected": "fouR"}, 3,
         same + " once cut to preference.max_completion=3: "),
        ({"prompt": question, "chosen": [{"role": "assistant", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "a"}]}, 0, same + ": "),
    ]
    for record, max_completion, want in cases:
        form = detect_form(record)
        assert form is not None and problem(record, form) is None
        counts = PairCounts()
        (got,) = encode_pairs([record], form, chatml, 0, max_completion, counts)
        if want is None:
            assert isinstance(got, Pair) and counts.pairs == 1
        else:
            assert isinstance(got, str) and got.startswith(want), got
            assert "prefers neither" in got
            assert (counts.records, counts.pairs, counts.completions_cut) == (1, 0, 0)
