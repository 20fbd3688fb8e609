"""Rewards a program can check: Python callables ``fn(prompts, completions, **fields) ->
list[float]``, one reward per completion, named by a built-in's name or ``module:function``
(an installed module, or a ``.py`` file: ``rewards/math.py:correct``).

Each call gets the prompts and completions as text, every other field of the records as a list
beside them (``answer=[...]``), and ``completion_ids``, the generated token ids. A reward that
raises, returns another number of values, or a value that is not a finite number stops the
run: ``RewardError`` names the function and the record.

Built-ins (their settings are keyword arguments in the config's ``args``):

- ``exact_match``: 1 when the completion, stripped, equals the record's ``field`` (``answer``).
- ``numeric_answer``: 1 when the number in the completion's last ``\\boxed{...}``, or else its
  last number, equals the record's ``field`` within ``tolerance``.
- ``format_regex``: 1 when ``pattern`` is found in the completion (``full``: matches it whole).
- ``length_penalty``: DAPO's soft penalty on long completions: 0 up to ``max_tokens -
  soft_tokens`` generated tokens, falling linearly to -1 at ``max_tokens`` and beyond.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import RewardSpec
from trainrun.data.errors import DataError

RewardFn = Callable[..., Sequence[float]]
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(DataError):
    """A reward function that failed on a batch of completions: one line, the run stops."""


@dataclasses.dataclass(frozen=True)
class Reward:
    """A reward function as the config names it, and its weight in the total."""

    name: str
    function: RewardFn
    weight: float = 1.0


def load(name: str, args: Mapping[str, Any] | None = None, weight: float = 1.0) -> Reward:
    """The reward ``name`` names: a built-in (made with ``args``), or ``module:function``
    (``args`` then bound as keyword arguments of each call). A name that finds nothing is a
    DataError naming it."""
    settings = dict(args or {})
    if name in BUILT_IN:
        try:
            return Reward(name, BUILT_IN[name](**settings), weight)
        except TypeError as error:
            raise DataError(f"reward {name}: {error}; see the built-in's settings") from None
    module_name, colon, attribute = name.rpartition(":")
    if not colon or not module_name or not attribute:
        raise DataError(f"reward {name!r} is neither a built-in ({', '.join(BUILT_IN)}) nor "
                        "module:function; name one")
    module = _module(module_name, name)
    found: RewardFn | None = getattr(module, attribute, None)
    if not callable(found):
        raise DataError(f"reward {name}: {module_name} has no function {attribute!r}")
    if not settings:
        return Reward(name, found, weight)

    def bound(prompts: Sequence[str], completions: Sequence[str],
              **fields: Any) -> Sequence[float]:
        return found(prompts, completions, **fields, **settings)

    return Reward(name, bound, weight)


def load_each(specs: Sequence[RewardSpec]) -> list[Reward]:
    """The rewards an ``rl.rewards`` list names, each as ``load`` finds it."""
    return [load(spec.name, spec.args, spec.weight) for spec in specs]


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          fields: Mapping[str, Sequence[Any]], where: Sequence[str]) -> np.ndarray:
    """``[rewards, completions]`` float64 values of each reward on the completions.
    ``where``: each completion's record (``file:line``), for errors."""
    out = np.zeros((len(rewards), len(completions)))
    for row, reward in enumerate(rewards):
        try:
            values = reward.function(list(prompts), list(completions),
                                     **{key: list(value) for key, value in fields.items()})
        except Exception as error:  # a user's function: any failure stops the run in one line
            raise RewardError(f"reward {reward.name} raised {type(error).__name__}: {error} "
                              f"(on the completions of {where[0]} and after); fix the "
                              "function") from None
        try:
            found = len(values)
        except TypeError:
            raise RewardError(f"reward {reward.name} returned {type(values).__name__}, not a "
                              f"list of numbers (records from {where[0]})") from None
        if found != len(completions):
            raise RewardError(f"reward {reward.name} returned {found} values for "
                              f"{len(completions)} completions (records from {where[0]}); "
                              "return one per completion")
        for column, value in enumerate(values):
            number = _finite(value)
            if number is None:
                raise RewardError(f"reward {reward.name} gave {value!r} for the completion "
                                  f"of {where[column]}; return a finite number")
            out[row, column] = number
    return out


def total(rewards: Sequence[Reward], values: np.ndarray) -> np.ndarray:
    """The weighted sum of each completion's rewards (``score``'s rows)."""
    weights = np.asarray([reward.weight for reward in rewards], np.float64)
    return weights @ values


def exact_match(field: str = "answer") -> RewardFn:
    def reward(prompts: Sequence[str], completions: Sequence[str],
               **fields: Any) -> list[float]:
        return [float(c.strip() == str(a).strip())
                for c, a in zip(completions, _field(fields, field), strict=True)]

    return reward


def numeric_answer(field: str = "answer", tolerance: float = 1e-6) -> RewardFn:
    def reward(prompts: Sequence[str], completions: Sequence[str],
               **fields: Any) -> list[float]:
        out = []
        for completion, answer in zip(completions, _field(fields, field), strict=True):
            got, want = final_number(completion), _number(str(answer))
            out.append(float(got is not None and want is not None
                             and abs(got - want) <= tolerance * max(1.0, abs(want))))
        return out

    return reward


def format_regex(pattern: str, full: bool = False) -> RewardFn:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise TypeError(f"pattern {pattern!r} is no regular expression ({error})") from None
    find = compiled.fullmatch if full else compiled.search

    def reward(prompts: Sequence[str], completions: Sequence[str],
               **fields: Any) -> list[float]:
        return [float(find(completion) is not None) for completion in completions]

    return reward


def length_penalty(max_tokens: int, soft_tokens: int) -> RewardFn:
    if not 0 < soft_tokens <= max_tokens:
        raise TypeError(f"give 0 < soft_tokens <= max_tokens, not {soft_tokens} and "
                        f"{max_tokens}")
    free = max_tokens - soft_tokens

    def reward(prompts: Sequence[str], completions: Sequence[str],
               **fields: Any) -> list[float]:
        lengths = [len(ids) for ids in fields["completion_ids"]]
        return [0.0 if n <= free else max(-1.0, (free - n) / soft_tokens) for n in lengths]

    return reward


BUILT_IN: dict[str, Callable[..., RewardFn]] = {
    "exact_match": exact_match, "numeric_answer": numeric_answer,
    "format_regex": format_regex, "length_penalty": length_penalty}


def final_number(text: str) -> float | None:
    """The number in ``text``'s last ``\\boxed{...}`` (braces nested inside it kept), else its
    last number; None when there is none."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, at = 0, start + len("\\boxed")
        for end in range(at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return _number(text[at + 1:end])
        return None
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def _number(text: str) -> float | None:
    try:
        value = float(text.strip().replace(",", "").rstrip("."))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _field(fields: Mapping[str, Any], name: str) -> Sequence[Any]:
    if name not in fields:
        raise KeyError(f"the records have no field {name!r} (they have: "
                       f"{', '.join(sorted(fields))})")
    return fields[name]


def _module(name: str, spec: str) -> Any:
    """The module ``name`` names: a ``.py`` file, else an importable module."""
    if name.endswith(".py"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise DataError(f"reward {spec}: no file {name}")
        found = importlib.util.spec_from_file_location(f"trainrun_reward_{path.stem}", path)
        if found is None or found.loader is None:
            raise DataError(f"reward {spec}: {name} cannot be loaded as Python")
        module = importlib.util.module_from_spec(found)
        try:
            found.loader.exec_module(module)
        except Exception as error:  # the user's file: its failure is named in one line
            raise DataError(f"reward {spec}: {name} raised {type(error).__name__} when "
                            f"loaded: {error}") from None
        return module
    try:
        return sys.modules.get(name) or importlib.import_module(name)
    except ImportError as error:
        raise DataError(f"reward {spec}: cannot import {name} ({error}); install it or "
                        "name a .py file") from None
