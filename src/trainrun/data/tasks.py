"""Synthetic chat tasks whose answer is a function of the prompt: data made on the spot, and a
held-out exact-match check of what a fine-tune learned.

- ``reverse``: ``reverse <letters>`` -> the letters backwards (4 to 7 lowercase letters).
- ``add``: ``add <a> + <b>`` -> their sum (0 to 99 each).
- ``last`` (preference pairs): ``last <letters>`` -> its last letter chosen over one of its
  other letters (4 to 7 different lowercase letters).
- ``letter``: ``last <letters>`` -> its last letter, as chat records (words as ``last``'s).

The records are drawn from a fixed seed, so every run (whatever its own seed) splits the same
records into the same training and held-out sets.
"""

from __future__ import annotations

import string

import numpy as np

TASKS = ("reverse", "add")
TASK_SEED = 20261201


def task_prompts(task: str, count: int) -> list[str]:
    """The first ``count`` prompts of ``task``."""
    rng = np.random.default_rng((TASK_SEED, TASKS.index(task)))
    if task == "reverse":
        letters = np.array(list(string.ascii_lowercase))
        lengths = rng.integers(4, 8, count)
        return ["reverse " + "".join(rng.choice(letters, n)) for n in lengths.tolist()]
    pairs = rng.integers(0, 100, (count, 2)).tolist()
    return [f"add {a} + {b}" for a, b in pairs]


def task_answer(task: str, prompt: str) -> str:
    """The one right answer to a prompt of ``task``."""
    if task == "reverse":
        return prompt.removeprefix("reverse ")[::-1]
    a, b = prompt.removeprefix("add ").split(" + ")
    return str(int(a) + int(b))


def task_records(task: str, count: int) -> list[dict[str, list[dict[str, str]]]]:
    """``count`` chat records: a user turn with the prompt, an assistant turn with its answer;
    for ``last``, conversational preference pairs: the prompt's user turn, the chosen and the
    rejected assistant turn."""
    if task == "last":
        return _last_letter_pairs(count)
    if task == "letter":  # the pairs' prompts with their chosen answers
        return [{"messages": [*pair["prompt"], *pair["chosen"]]}
                for pair in _last_letter_pairs(count)]
    return [{"messages": [{"role": "user", "content": prompt},
                          {"role": "assistant", "content": task_answer(task, prompt)}]}
            for prompt in task_prompts(task, count)]


def _last_letter_pairs(count: int) -> list[dict[str, list[dict[str, str]]]]:
    rng = np.random.default_rng((TASK_SEED, len(TASKS)))
    records = []
    for _ in range(count):
        word = rng.permutation(list(string.ascii_lowercase))[:rng.integers(4, 8)]
        other = str(word[rng.integers(0, word.size - 1)])
        records.append({"prompt": [{"role": "user", "content": "last " + "".join(word)}],
                        "chosen": [{"role": "assistant", "content": str(word[-1])}],
                        "rejected": [{"role": "assistant", "content": other}]})
    return records
