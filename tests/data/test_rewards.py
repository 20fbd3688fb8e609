"""Reward functions: the built-ins, a user's function from a file, and one-line failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainrun.data import rewards
from trainrun.data.errors import DataError

WHERE = ["tasks.jsonl:1", "tasks.jsonl:2", "tasks.jsonl:3"]


def _score(reward: rewards.Reward, completions: list[str], **fields: list[object]) -> list[float]:
    fields.setdefault("completion_ids", [[0] * len(c) for c in completions])
    return rewards.score([reward], ["q"] * len(completions), completions, fields,
                         WHERE[:len(completions)])[0].tolist()


def test_exact_match_strips_the_completion() -> None:
    assert _score(rewards.load("exact_match"), [" 42\n", "41", "42."],
                  answer=["42", "42", "42"]) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("text,number", [
    ("so the answer is \\boxed{12}", 12.0),
    ("\\boxed{3} no, \\boxed{\\frac{1}{2}} ... \\boxed{1,234.5}", 1234.5),
    ("first 7 then -3.5e2.", -350.0),
    ("no number here", None),
    ("\\boxed{12", None),
])
def test_final_number_reads_boxed_then_the_last_number(text: str, number: float | None) -> None:
    assert rewards.final_number(text) == number


def test_numeric_answer_compares_numbers() -> None:
    assert _score(rewards.load("numeric_answer", {"field": "gold"}),
                  ["it is \\boxed{0.5}", "1/2", "x = 3.0000001"],
                  gold=["1/2", 0.5, "3"]) == [0.0, 0.0, 1.0]


def test_format_regex_and_length_penalty() -> None:
    fmt = rewards.load("format_regex", {"pattern": r"<think>.*</think>\s*\S", "full": False})
    assert _score(fmt, ["<think>a\nb</think> 4", "4", "<think></think>"]) == [1.0, 0.0, 0.0]
    penalty = rewards.load("length_penalty", {"max_tokens": 10, "soft_tokens": 4})
    assert _score(penalty, ["a"] * 3, completion_ids=[[0] * 6, [0] * 8, [0] * 30]) == [
        0.0, -0.5, -1.0]


def test_a_user_function_from_a_file_gets_the_record_fields(tmp_path: Path) -> None:
    file = tmp_path / "my_rewards.py"
    file.write_text("def longer(prompts, completions, answer, scale=1.0, **rest):\n"
                    "    return [scale * (len(c) > len(a)) for c, a in zip(completions, answer)]\n")
    reward = rewards.load(f"{file}:longer", {"scale": 2.0}, weight=0.5)
    values = rewards.score([reward, rewards.load("exact_match")], ["q", "q"], ["abc", "x"],
                           {"answer": ["ab", "x"], "completion_ids": [[1], [2]]}, WHERE)
    np.testing.assert_array_equal(values, [[2.0, 0.0], [0.0, 1.0]])
    np.testing.assert_array_equal(rewards.total([reward, rewards.load("exact_match")], values),
                                  [1.0, 1.0])


def test_an_installed_module_function_loads() -> None:
    reward = rewards.load("trainrun.data.rewards:final_number")
    assert reward.function is rewards.final_number


@pytest.mark.parametrize("source,words", [
    ("def f(prompts, completions, **k):\n    raise ValueError('boom')\n",
     "reward {f}:f raised ValueError: boom (on the completions of tasks.jsonl:1"),
    ("def f(prompts, completions, **k):\n    return [1.0]\n", "returned 1 values for 2"),
    ("def f(prompts, completions, **k):\n    return [1.0, float('nan')]\n",
     "gave nan for the completion of tasks.jsonl:2"),
    ("def f(prompts, completions, **k):\n    return 3\n", "returned int, not a list"),
    ("def f(prompts, completions, **k):\n    return [1.0, 'good']\n", "gave 'good'"),
])
def test_a_failing_reward_is_one_line_naming_it_and_the_record(tmp_path: Path, source: str,
                                                              words: str) -> None:
    file = tmp_path / "bad.py"
    file.write_text(source)
    reward = rewards.load(f"{file}:f")
    with pytest.raises(rewards.RewardError) as caught:
        rewards.score([reward], ["q", "q"], ["a", "b"], {}, WHERE[:2])
    message = str(caught.value)
    assert words.format(f=file) in message and "\n" not in message


@pytest.mark.parametrize("name,args,words", [
    ("no_such", None, "neither a built-in"),
    ("nosuchmodule_xyz:f", None, "cannot import nosuchmodule_xyz"),
    ("trainrun.data.rewards:nothing", None, "has no function 'nothing'"),
    ("missing.py:f", None, "no file missing.py"),
    ("format_regex", {"pattern": "("}, "no regular expression"),
    ("length_penalty", {"max_tokens": 4, "soft_tokens": 9}, "soft_tokens <= max_tokens"),
    ("exact_match", {"fieldd": "x"}, "unexpected keyword"),
])
def test_a_reward_that_cannot_load_is_named(name: str, args: dict[str, object] | None,
                                            words: str) -> None:
    with pytest.raises(DataError, match=words.replace("(", r"\(")):
        rewards.load(name, args)
