"""Reward functions: the built-ins, a user's function from a file (importing a module beside
it), TRL's call (by keyword, with ``trainer_state``), None where a reward does not apply, the
time limit, and one-line failures (``SystemExit`` and ``KeyboardInterrupt`` included)."""

from __future__ import annotations

import io
import signal
import sys
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
    ("import sys\n\ndef f(prompts, completions, **k):\n    sys.exit(0)\n",
     "reward {f}:f raised SystemExit: 0 (on the completions of tasks.jsonl:1"),
    ("def f(prompts, completions, **k):\n    raise SystemExit('done')\n",
     "reward {f}:f raised SystemExit: done (on the completions of tasks.jsonl:1"),
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


def test_a_keyboard_interrupt_of_the_function_is_its_failure_under_a_runs_handler(
        tmp_path: Path) -> None:
    """Under a run's own SIGINT handler no Ctrl-C raises KeyboardInterrupt: one raised in a
    reward is the function's, named in one line. With Python's default handler it may be a
    Ctrl-C, and goes on as one."""
    from trainrun.training.preemption import Preemption

    file = tmp_path / "interrupting.py"
    file.write_text("def f(prompts, completions, **k):\n    raise KeyboardInterrupt\n")
    reward = rewards.load(f"{file}:f")
    # Python's own handler, as a process started in the background by a shell has SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            rewards.score([reward], ["q"], ["a"], {}, WHERE[:1])
    finally:
        signal.signal(signal.SIGINT, previous)
    with Preemption(err=io.StringIO()), pytest.raises(rewards.RewardError) as caught:
        rewards.score([reward], ["q"], ["a"], {}, WHERE[:1])
    assert str(caught.value) == (f"reward {file}:f raised KeyboardInterrupt (on the completions "
                                 "of tasks.jsonl:1 and after); fix the function")


def test_a_reward_that_does_not_return_in_time_is_one_line_naming_it(tmp_path: Path) -> None:
    file = tmp_path / "slow.py"
    file.write_text("import time\n\n\ndef hangs(completions, **kwargs):\n"
                    "    time.sleep(1000)\n    return [0.0] * len(completions)\n")
    reward = rewards.load(f"{file}:hangs", timeout=0.5)
    previous = signal.getsignal(signal.SIGALRM)
    with pytest.raises(rewards.RewardError) as caught:
        rewards.score([reward], ["q", "q"], ["a", "b"], {}, WHERE[:2])
    assert str(caught.value) == (
        f"reward {file}:hangs did not return within 0.5 s (rl.reward_timeout) on the "
        "completions of tasks.jsonl:1 and after; make it return sooner, or raise "
        "rl.reward_timeout")
    assert signal.getsignal(signal.SIGALRM) is previous  # the handler was the call's alone


def test_a_function_written_for_trl_is_called_as_trl_calls_it(tmp_path: Path) -> None:
    """By keyword, with ``completion_ids``, the record fields and ``trainer_state``: a
    function whose parameters are TRL's (``completions`` first, no ``prompts``) runs as it is,
    and TRL's own reward functions too."""
    pytest.importorskip("trl")
    from trl.rewards import think_format_reward

    file = tmp_path / "trl_style.py"
    file.write_text(
        "def shaped(completions, completion_ids, trainer_state, solution, **kwargs):\n"
        "    late = trainer_state.global_step / trainer_state.max_steps\n"
        "    return [late * (c[0]['content'] == s) + len(ids) / 100\n"
        "            for c, s, ids in zip(completions, solution, completion_ids)]\n")
    completions = [[{"role": "assistant", "content": text}]
                   for text in ("<think>so</think>4", "4", "<think>x</think> 5")]
    prompts = [[{"role": "user", "content": "2+2?"}]] * 3
    fields = {"solution": ["<think>so</think>4", "4", "5"], "completion_ids": [[1] * 5, [2], []]}
    found = rewards.score(
        [rewards.load(f"{file}:shaped"), rewards.load("trl.rewards:think_format_reward")],
        prompts, completions, fields, WHERE, rewards.RunProgress(global_step=3, max_steps=12))
    np.testing.assert_array_equal(found[0], [0.25 + 0.05, 0.25 + 0.01, 0.0])
    as_trl = think_format_reward(prompts=prompts, completions=completions, **fields)
    np.testing.assert_array_equal(found[1], as_trl)


def test_an_async_reward_function_is_awaited(tmp_path: Path) -> None:
    """TRL takes ``async def`` reward functions (a judge behind a network call) too."""
    file = tmp_path / "judged.py"
    file.write_text("import asyncio\n\n\nasync def judged(completions, **kwargs):\n"
                    "    await asyncio.sleep(0)\n"
                    "    return [float(len(c[0]['content'])) for c in completions]\n")
    completions = [[{"role": "assistant", "content": text}] for text in ("ab", "abc")]
    found = rewards.score([rewards.load(f"{file}:judged", timeout=60.0)], ["q", "q"],
                          completions, {}, WHERE[:2])
    assert found.tolist() == [[2.0, 3.0]]


def test_none_is_left_out_of_the_total_and_a_completion_none_scores_has_none(
        tmp_path: Path) -> None:
    file = tmp_path / "partial.py"
    file.write_text("def first(completions, a, **kwargs):\n    return a\n\n\n"
                    "def second(completions, b, **kwargs):\n    return b\n")
    found = [rewards.load(f"{file}:first"), rewards.load(f"{file}:second", weight=2.0)]
    values = rewards.score(found, ["q"] * 3, ["x", "y", "z"],
                           {"a": [1.0, None, None], "b": [0.5, 2.0, None]}, WHERE)
    np.testing.assert_array_equal(values, [[1.0, np.nan, np.nan], [0.5, 2.0, np.nan]])
    with pytest.warns(rewards.UnscoredWarning, match="returned None for some completions"):
        total = rewards.total(found, values)
    np.testing.assert_array_equal(total, [2.0, 4.0, np.nan])  # 1 + 2 * 0.5; 2 * 2; none
    assert rewards.mean_and_std(values[0]) == (1.0, 0.0)  # over the completions it scored


def test_a_reward_file_imports_a_module_beside_it(tmp_path: Path) -> None:
    folder = tmp_path / "my_rewards"
    folder.mkdir()
    (folder / "grading_rules_xyz.py").write_text("POINTS = 3.0\n")
    (folder / "graded.py").write_text(
        "from grading_rules_xyz import POINTS\n\n\n"
        "def points(completions, **kwargs):\n    return [POINTS for _ in completions]\n")
    path_before = list(sys.path)
    reward = rewards.load(f"{folder / 'graded.py'}:points")
    assert sys.path == path_before  # the folder was on the path while the file loaded
    assert rewards.score([reward], ["q"], ["a"], {}, WHERE[:1]).tolist() == [[3.0]]
