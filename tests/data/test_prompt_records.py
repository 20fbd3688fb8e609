"""Prompt records for reinforcement learning: text and message prompts encoded as the model
reads them, the other fields kept for the rewards, a chat record's last answer as its
``answer``, every n-th record held out, bad records refused in one line or counted."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainrun.config import RecordsData
from trainrun.data import model_tokenizer
from trainrun.data.errors import DataError
from trainrun.data.prompt_records import prompt_records


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
