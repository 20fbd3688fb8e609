"""Prompt records for reinforcement learning: text and message prompts encoded as the model
reads them, the other fields kept for the rewards, a chat record's last answer as its
``answer``, every n-th record held out, bad records refused in one line or counted; the rewards
get a conversation's prompt as its messages and each completion as a message, as TRL hands
them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainrun.config import RecordsData
from trainrun.data import model_tokenizer, rewards
from trainrun.data.errors import DataError
from trainrun.data.prompt_records import prompt_records, score_completions


def _section(*paths: Path, **changes: object) -> RecordsData:
    settings: dict[str, object] = {"eval_fraction": 0.0, "tokenizer": "bytes",
                                   "chat_template": "chatml", **changes}
    return RecordsData(paths=tuple(str(p) for p in paths), seq_len=64,
                       **settings)  # type: ignore[arg-type]


def _jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_and_message_prompts_keep_the_fields_the_rewards_read(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+2=", "answer": "4", "level": 1},
        {"prompt": [{"role": "user", "content": "hi"}], "answer": "hello"},
        {"messages": [{"role": "user", "content": "reverse ab"},
                      {"role": "assistant", "content": "ba"}]}])
    found = prompt_records(_section(source), 32)
    bytes_ = model_tokenizer.byte_tokenizer()
    text, chat, record = found.train
    assert text.ids.tolist() == bytes_.tokenizer.encode("2+2=").ids  # a text's start
    assert text.fields == {"answer": "4", "level": 1} and text.where.endswith("p.jsonl:1")
    assert chat.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat.ids.tolist() == bytes_.tokenizer.encode(chat.text,
                                                        add_special_tokens=False).ids
    assert record.fields == {"answer": "ba"} and "reverse ab" in record.text
    assert "ba" not in record.text.split("assistant")[-1]  # the answer is not in the prompt
    assert found.eval == [] and found.files and found.skipped == []


def test_parquet_prompts_keep_every_column(tmp_path: Path) -> None:
    table = pa.table({"prompt": ["a", "b"], "answer": ["1", "2"], "extra": [3, 4]})
    pq.write_table(table, tmp_path / "p.parquet")
    found = prompt_records(_section(tmp_path / "p.parquet"), 32)
    assert [p.fields for p in found.train] == [{"answer": "1", "extra": 3},
                                               {"answer": "2", "extra": 4}]


def test_every_nth_record_is_held_out(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(8)])
    found = prompt_records(_section(source, eval_fraction=0.25), 32)
    assert [p.text for p in found.eval] == ["q3", "q7"]
    assert len(found.train) == 6


@pytest.mark.parametrize("record,words", [
    ({"question": "x"}, "has neither a 'prompt' nor a 'messages' field"),
    ({"prompt": [{"role": "user"}]}, "message 0 has no 'content'"),
    ({"prompt": "x" * 40}, "more than the 32 that leave room for a completion"),
])
def test_a_bad_record_is_refused_in_one_line_or_counted(tmp_path: Path, record: object,
                                                        words: str) -> None:
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, record])
    with pytest.raises(DataError) as err:
        prompt_records(_section(source), 32)
    assert words in str(err.value) and "p.jsonl:2" in str(err.value)
    assert "\n" not in str(err.value)
    found = prompt_records(_section(source, bad_records="skip"), 32)
    assert len(found.train) == 1 and len(found.skipped) == 1


def test_the_rewards_get_a_conversation_as_messages_and_a_text_as_text(tmp_path: Path) -> None:
    """TRL's shapes: a conversational prompt is its messages (a chat record's without its
    answer) and its completion ``[{"role": "assistant", "content": text}]``; a text prompt and
    its completion are texts. Each completion gets its own prompt's shape."""
    pytest.importorskip("trl")
    from trl.data_utils import is_conversational

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    source = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": chat, "answer": "hello"},
        {"messages": [{"role": "user", "content": "reverse ab"},
                      {"role": "assistant", "content": "ba"}]},
        {"prompt": "2+2=", "answer": "4"}])
    asked = prompt_records(_section(source), 48).train
    seen: dict[str, list[object]] = {}

    def recorded(prompts: list[object], completions: list[object], **fields: object,
                 ) -> list[float]:
        seen.update(prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    values = score_completions([rewards.Reward("recorded", recorded)], asked,
                               ["hello", "ba", "4"], [np.array([5, 6]), np.array([7]),
                                                      np.array([8])])
    assert values.tolist() == [[1.0, 1.0, 1.0]]
    assert seen["prompts"] == [chat, [{"role": "user", "content": "reverse ab"}], "2+2="]
    assert seen["completions"] == [[{"role": "assistant", "content": "hello"}],
                                   [{"role": "assistant", "content": "ba"}], "4"]
    assert [is_conversational({"prompt": p, "completion": c})
            for p, c in zip(seen["prompts"], seen["completions"], strict=True)] == [
        True, True, False]
    # the built-ins read a message's content as they read a text
    assert score_completions([rewards.load("exact_match")], asked, ["hello", "b", "4"],
                             [np.array([1])] * 3).tolist() == [[1.0, 0.0, 1.0]]
