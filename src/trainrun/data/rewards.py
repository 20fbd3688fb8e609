"""Rewards a program can check: Python callables, one reward per completion, named by a
built-in's name or ``module:function`` (an installed module, or a ``.py`` file:
``rewards/math.py:correct``; the file's folder is on the import path while it loads, so it can
import a module beside it). A reward function written for TRL's ``GRPOTrainer`` runs unchanged
(an ``async`` one too).

Each call is TRL's: by keyword, ``prompts`` and ``completions`` (texts; for conversational
records, each prompt its list of messages and each completion a list of one assistant message,
``[{"role": "assistant", "content": text}]``), ``completion_ids`` (the generated token ids),
every other field of the records as a list beside them (``answer=[...]``), and
``trainer_state``, the run's progress (``global_step``, ``max_steps``). A reward may return
None for a completion it does not apply to: the total is the weighted sum of the others', and a
completion none applies to has no total (NaN: no advantage, left out of the means; a warning
says so), as TRL combines them. A reward that raises (``SystemExit`` and ``KeyboardInterrupt``
included), returns another number of values, a value that is neither a finite number nor None,
or does not return within its time limit (``rl.reward_timeout``,
``platform/time_limit.py``) stops the run: ``RewardError`` names the function and the record.

Built-ins (their settings are keyword arguments in the config's ``args``):

- ``exact_match``: 1 when the completion, stripped, equals the record's ``field`` (``answer``).
- ``numeric_answer``: 1 when the number in the completion's last ``\\boxed{...}``, or else its
  last number, equals the record's ``field`` within ``tolerance``.
- ``format_regex``: 1 when ``pattern`` is found in the completion (``full``: matches it whole).
- ``length_penalty``: DAPO's soft penalty on long completions: 0 up to ``max_tokens -
  soft_tokens`` generated tokens, falling linearly to -1 at ``max_tokens`` and beyond.
- ``reward_model``: the score of a trained reward model at ``path``
  (``training/model_reward.py``, which loads models and so lives above this floor: it is
  handed to ``load`` as one of its ``built_in``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import inspect
import math
import re
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import RewardSpec
from trainrun.data.errors import DataError
from trainrun.errors import LineWarning
from trainrun.platform.time_limit import TimedOut, call_within

RewardFn = Callable[..., Sequence[float | None]]
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(DataError):
    """A reward function that failed on a batch of completions: one line, the run stops."""


class UnscoredWarning(LineWarning):
    """Every reward returned None for a completion: it has no total and no advantage."""


@dataclasses.dataclass(frozen=True)
class Reward:
    """A reward function as the config names it, its weight in the total and the seconds a
    call may take (None: no limit)."""

    name: str
    function: RewardFn
    weight: float = 1.0
    timeout: float | None = None


@dataclasses.dataclass(frozen=True)
class RunProgress:
    """The run's progress, handed to each call as ``trainer_state`` (the names are those of
    the ``TrainerState`` TRL hands): ``global_step``, the optimizer steps taken before the
    completions were drawn (or before the params evaluated), and ``max_steps``, the run's."""

    global_step: int
    max_steps: int


def load(name: str, args: Mapping[str, Any] | None = None, weight: float = 1.0,
         timeout: float | None = None,
         built_in: Mapping[str, Callable[..., RewardFn]] | None = None) -> Reward:
    """The reward ``name`` names: a built-in (made with ``args``), or ``module:function``
    (``args`` then bound as keyword arguments of each call). A name that finds nothing is a
    DataError naming it. ``built_in``: the built-ins by name (None: ``BUILT_IN``)."""
    settings = dict(args or {})
    built_in = BUILT_IN if built_in is None else built_in
    if name in built_in:
        try:
            return Reward(name, built_in[name](**settings), weight, timeout)
        except TypeError as error:
            raise DataError(f"reward {name}: {error}; see the built-in's settings") from None
    module_name, colon, attribute = name.rpartition(":")
    if not colon or not module_name or not attribute:
        raise DataError(f"reward {name!r} is neither a built-in ({', '.join(built_in)}) nor "
                        "module:function; name one")
    module = _module(module_name, name)
    found: RewardFn | None = getattr(module, attribute, None)
    if not callable(found):
        raise DataError(f"reward {name}: {module_name} has no function {attribute!r}")
    if not settings:
        return Reward(name, found, weight, timeout)

    def bound(**arguments: Any) -> Sequence[float | None]:
        return found(**arguments, **settings)

    return Reward(name, bound, weight, timeout)


def load_each(specs: Sequence[RewardSpec], timeout: float | None = None,
              built_in: Mapping[str, Callable[..., RewardFn]] | None = None) -> list[Reward]:
    """The rewards an ``rl.rewards`` list names, each as ``load`` finds it (``built_in``: as
    ``load``'s), each call limited to ``timeout`` seconds (``rl.reward_timeout``)."""
    return [load(spec.name, spec.args, spec.weight, timeout, built_in) for spec in specs]


def score(rewards: Sequence[Reward], prompts: Sequence[Any], completions: Sequence[Any],
          fields: Mapping[str, Sequence[Any]], where: Sequence[str],
          progress: RunProgress | None = None) -> np.ndarray:
    """``[rewards, completions]`` float64 values of each reward on the completions, NaN where a
    reward returned None. ``prompts``, ``completions``: as the rewards get them (texts, or
    messages); ``fields``: each a list beside them (``completion_ids`` among them);
    ``progress``: ``trainer_state``; ``where``: each completion's record (``file:line``), for
    errors."""
    out = np.zeros((len(rewards), len(completions)))
    arguments = {**{key: list(value) for key, value in fields.items()},
                 "trainer_state": progress}
    for row, reward in enumerate(rewards):
        values = _called(reward, {**arguments, "prompts": list(prompts),
                                  "completions": list(completions)}, where)
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
            number = math.nan if value is None else _finite(value)
            if number is None:
                raise RewardError(f"reward {reward.name} gave {value!r} for the completion "
                                  f"of {where[column]}; return a finite number, or None where "
                                  "the reward does not apply")
            out[row, column] = number
    return out


def _called(reward: Reward, arguments: dict[str, Any], where: Sequence[str]) -> Any:
    """The reward's values, called by keyword as TRL calls it, within its time limit."""
    def values() -> Any:
        found = reward.function(**arguments)
        return asyncio.run(found) if inspect.iscoroutine(found) else found  # TRL's async too

    try:
        return call_within(reward.timeout, values)
    except TimedOut:
        raise RewardError(f"reward {reward.name} did not return within {reward.timeout:g} s "
                          f"(rl.reward_timeout) on the completions of {where[0]} and after; "
                          "make it return sooner, or raise rl.reward_timeout") from None
    except BaseException as error:  # a user's function: any failure stops the run in one line
        # a run's own SIGINT handler raises nothing: only under Python's may this be a Ctrl-C
        if isinstance(error, KeyboardInterrupt) and (
                signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            raise
        said = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise RewardError(f"reward {reward.name} raised {said} (on the completions of "
                          f"{where[0]} and after); fix the function") from None


def total(rewards: Sequence[Reward], values: np.ndarray) -> np.ndarray:
    """The weighted sum of each completion's rewards (``score``'s rows), those that returned
    None left out; NaN for a completion every reward returned None for (TRL's rule)."""
    weights = np.asarray([reward.weight for reward in rewards], np.float64)
    unscored = np.isnan(values).all(axis=0)
    if unscored.any():
        warnings.warn(UnscoredWarning(
            f"every reward ({', '.join(r.name for r in rewards)}) returned None for some "
            "completions: they have no reward and no advantage; return a number from at least "
            "one reward for each completion"), stacklevel=2)
    summed = np.nansum(weights[:, None] * values, axis=0)
    return np.where(unscored, np.nan, summed)


def mean_and_std(values: np.ndarray) -> tuple[float, float]:
    """The mean and standard deviation of ``values``' numbers, NaNs (None) left out; NaN when
    there is none (TRL's ``nanmean``)."""
    kept = values[~np.isnan(values)]
    return (float(kept.mean()), float(kept.std())) if kept.size else (math.nan, math.nan)


def completion_text(completion: Any) -> str:
    """A completion's text: itself, or its last message's content (conversational records)."""
    return completion if isinstance(completion, str) else str(completion[-1]["content"])


def exact_match(field: str = "answer") -> RewardFn:
    def reward(prompts: Sequence[Any], completions: Sequence[Any],
               **fields: Any) -> list[float]:
        return [float(completion_text(c).strip() == str(a).strip())
                for c, a in zip(completions, _field(fields, field), strict=True)]

    return reward


def numeric_answer(field: str = "answer", tolerance: float = 1e-6) -> RewardFn:
    def reward(prompts: Sequence[Any], completions: Sequence[Any],
               **fields: Any) -> list[float]:
        out = []
        for completion, answer in zip(completions, _field(fields, field), strict=True):
            got, want = final_number(completion_text(completion)), _number(str(answer))
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

    def reward(prompts: Sequence[Any], completions: Sequence[Any],
               **fields: Any) -> list[float]:
        return [float(find(completion_text(c)) is not None) for c in completions]

    return reward


def length_penalty(max_tokens: int, soft_tokens: int) -> RewardFn:
    if not 0 < soft_tokens <= max_tokens:
        raise TypeError(f"give 0 < soft_tokens <= max_tokens, not {soft_tokens} and "
                        f"{max_tokens}")
    free = max_tokens - soft_tokens

    def reward(prompts: Sequence[Any], completions: Sequence[Any],
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
            with _importable_beside(path):
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


@contextmanager
def _importable_beside(path: Path) -> Iterator[None]:
    """``path``'s folder first on the import path while the file loads, as ``python path``
    has it: the file can import a module beside it (a module it imports stays loaded)."""
    folder = str(path.resolve().parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
