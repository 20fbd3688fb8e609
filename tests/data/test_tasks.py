"""Synthetic tasks: each record's answer is the function of its prompt the task names."""

from __future__ import annotations

from trainrun.data.tasks import task_records


def test_a_letter_record_answers_its_words_last_letter_as_the_last_pairs_prefer() -> None:
    records = task_records("letter", 50)
    for record, pair in zip(records, task_records("last", 50), strict=True):
        user, assistant = record["messages"]
        word = user["content"].removeprefix("last ")
        assert user["role"] == "user" and 4 <= len(word) <= 7 and len(set(word)) == len(word)
        assert assistant == {"role": "assistant", "content": word[-1]}
        assert [user] == pair["prompt"] and [assistant] == pair["chosen"]
