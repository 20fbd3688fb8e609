"""A preference record as one pair: the prompt's token ids and the chosen and the rejected
completion's, in the three forms TRL's users hold them.

- ``standard``: ``prompt``, ``chosen`` and ``rejected`` strings. The prompt is encoded as a
  text's start (with the tokenizer's special tokens), each completion after it, then ``eos``.
- ``conversational``: ``prompt`` a list of messages, ``chosen`` and ``rejected`` lists of the
  assistant's messages. ``render(prompt, add_generation_prompt=True)`` is the prompt; what
  ``render(prompt + chosen)`` adds after it, without trailing whitespace (never generated:
  decoding stops at the end-of-turn token), is the chosen completion, as for chat records.
- ``implicit``: ``chosen`` and ``rejected`` alone, whole texts or conversations that share the
  prompt: their longest common start is the prompt (whole messages, or text up to the last
  space before the two part, as TRL's ``extract_prompt`` splits them).

Truncation is explicit: a prompt longer than ``max_prompt`` keeps its end (what the answer
follows), a completion longer than ``max_completion`` its start; both are counted. A record whose
two answers are the same tokens (once cut) is not a pair: it prefers neither, so it is a bad
record, described in the pair's place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from trainrun.data.chat import check_messages
from trainrun.data.errors import DataError
from trainrun.data.model_tokenizer import ModelTokenizer
from trainrun.data.records import describe

PairForm = Literal["standard", "conversational", "implicit"]
FIELDS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference pair's token ids (uint32): the prompt, then either completion; and, for
    a reward model's records that give one, the margin its chosen answer should win by."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    margin: float | None = None


@dataclasses.dataclass
class PairCounts:
    """What became of a source's preference records."""

    records: int = 0  # read, bad ones included
    pairs: int = 0  # encoded
    prompts_cut: int = 0  # prompts cut to max_prompt (their end kept)
    completions_cut: int = 0  # pairs with a completion cut to max_completion

    def add(self, other: PairCounts) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def detect_form(record: Mapping[str, Any]) -> PairForm | None:
    """The form of a record by its fields (None: it has no ``chosen`` and ``rejected``)."""
    if "chosen" not in record or "rejected" not in record:
        return None
    if "prompt" not in record:
        return "implicit"
    return "standard" if isinstance(record["prompt"], str) else "conversational"


def problem(record: Mapping[str, Any], form: PairForm) -> str | None:
    """What makes ``record`` unusable as a ``form`` pair (None: nothing)."""
    names = FIELDS if form != "implicit" else FIELDS[1:]
    for name in names:
        if name not in record:
            return f"no {name!r} field (its fields: {', '.join(sorted(record)) or 'none'})"
    if form == "standard" or (form == "implicit" and isinstance(record["chosen"], str)):
        return _text_problem(record, form, names)
    for name in names:
        wrong = _messages(record[name], needs_assistant=name != "prompt")
        if wrong is not None:
            return f"field {name!r}: {wrong}"
    return _turns_problem(record, form)


def _text_problem(record: Mapping[str, Any], form: PairForm,
                  names: tuple[str, ...]) -> str | None:
    for name in names:
        if not isinstance(record[name], str):
            return f"field {name!r} is {describe(record[name])}, not a string"
    if form == "implicit" and not _text_prompt(record["chosen"], record["rejected"])[0]:
        return "'chosen' and 'rejected' share no prompt at their start"
    return None


def _turns_problem(record: Mapping[str, Any], form: PairForm) -> str | None:
    """What is wrong with a conversational pair's turns, its messages each well formed."""
    chosen, rejected = record["chosen"], record["rejected"]
    if form == "conversational":
        for name, turns in (("chosen", chosen), ("rejected", rejected)):
            if any(message["role"] != "assistant" for message in turns):
                return f"field {name!r} holds a message whose role is not 'assistant'"
        return None
    prompt = _shared_messages(chosen, rejected)
    if not prompt:
        return "'chosen' and 'rejected' share no first message: no prompt to split off"
    if len(prompt) == min(len(chosen), len(rejected)):
        return "'chosen' or 'rejected' has no message after the prompt they share"
    return None


def split(record: Mapping[str, Any], form: PairForm) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a record ``problem`` passed, the prompt split off an
    implicit one: three strings, or three lists of messages."""
    if form != "implicit":
        return record["prompt"], record["chosen"], record["rejected"]
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str):
        prompt, cut = _text_prompt(chosen, rejected)
        return prompt, chosen[cut:], rejected[cut:]
    shared = len(_shared_messages(chosen, rejected))
    return chosen[:shared], chosen[shared:], rejected[shared:]


def encode_pairs(records: Sequence[Mapping[str, Any]], form: PairForm,
                 tokenizer: ModelTokenizer, max_prompt: int, max_completion: int,
                 counts: PairCounts, margins: bool = False) -> list[Pair | str]:
    """Records ``problem`` passed as pairs, in order; one whose conversation the chat template
    cannot split into prompt and completion, or whose answers are the same tokens, gives what
    is wrong with it in its place.
    ``max_prompt``, ``max_completion``: the most tokens kept of each (0: no limit).
    ``margins``: each pair carries its record's ``margin`` field (a finite number; a record
    without one is a bad record)."""
    pieces = [split(record, form) for record in records]
    out: list[Pair | str] = []
    for record, item in zip(records, _encoded(pieces, tokenizer), strict=True):
        counts.records += 1
        margin = _margin(record) if margins else None
        if isinstance(item, str) or isinstance(margin, str):
            out.append(item if isinstance(item, str) else str(margin))
            continue
        prompt, chosen, rejected = item
        out.append(_cut(Pair(prompt, chosen, rejected, margin), max_prompt, max_completion,
                        counts))
    return out


def encode_sequences(prompts: Sequence[Any], completions: Sequence[Any],
                     tokenizer: ModelTokenizer) -> list[np.ndarray | str]:
    """Each prompt and its completion as one sequence's token ids (uint32), encoded as a
    pair's prompt and chosen answer are (strings, or lists of messages as a pair's); what is
    wrong with one in its place."""
    pieces = [(prompt, completion) for prompt, completion in zip(prompts, completions,
                                                                 strict=True)]
    return [item if isinstance(item, str) else np.concatenate(item)
            for item in _encoded(pieces, tokenizer)]


def _encoded(pieces: Sequence[tuple[Any, ...]], tokenizer: ModelTokenizer,
             ) -> list[tuple[np.ndarray, ...] | str]:
    """Each ``(prompt, answer, ...)`` (strings, or lists of messages) as the prompt's token ids
    and each answer's after it (uint32), or what is wrong with it: a text's prompt is encoded
    as its start (with the tokenizer's special tokens), each answer after it, then ``eos``; a
    conversation's prompt as the chat template renders it with the generation prompt, each
    answer as what the template adds after it."""
    chat = bool(pieces) and not isinstance(pieces[0][0], str)
    texts: list[tuple[str, ...] | str] = [
        _rendered(tokenizer, piece[0], *piece[1:]) if chat else tuple(piece)
        for piece in pieces]
    lib = tokenizer.tokenizer
    whole = [t for t in texts if not isinstance(t, str)]
    prompts = lib.encode_batch([t[0] for t in whole], add_special_tokens=not chat)
    answers = iter(lib.encode_batch([part for t in whole for part in t[1:]],
                                    add_special_tokens=False))
    end = [] if chat or tokenizer.eos_id is None else [tokenizer.eos_id]
    out: list[tuple[np.ndarray, ...] | str] = []
    done = 0
    for item in texts:
        if isinstance(item, str):
            out.append(item)
            continue
        parts = [np.asarray([*next(answers).ids, *end], np.uint32) for _ in item[1:]]
        out.append((np.asarray(prompts[done].ids, np.uint32), *parts))
        done += 1
    return out


def _margin(record: Mapping[str, Any]) -> float | str:
    """A record's ``margin`` as a float, or what is wrong with it."""
    value = record.get("margin")
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        given = "no 'margin' field" if "margin" not in record else (
            f"field 'margin' is {describe(value)}")
        return (f"{given}, not a finite number (reward_model.margin reads each pair's margin; "
                "set it to false for records without one)")
    return float(value)


def _cut(pair: Pair, max_prompt: int, max_completion: int, counts: PairCounts) -> Pair | str:
    """``pair`` cut to the limits and counted; what is wrong with it where its two answers are
    the same tokens (its preference term is a constant: nothing to learn, only float noise in
    the rewards' comparison)."""
    prompt, chosen, rejected = pair.prompt, pair.chosen, pair.rejected
    prompt_cut = bool(max_prompt) and prompt.size > max_prompt
    if prompt_cut:
        prompt = prompt[prompt.size - max_prompt:]
    answers_cut = bool(max_completion) and max(chosen.size, rejected.size) > max_completion
    if answers_cut:
        chosen, rejected = chosen[:max_completion], rejected[:max_completion]
    if np.array_equal(chosen, rejected):
        cut = f" once cut to preference.max_completion={max_completion}" if answers_cut else ""
        return f"'chosen' and 'rejected' are the same tokens{cut}: the pair prefers neither"
    counts.prompts_cut += prompt_cut
    counts.completions_cut += answers_cut
    counts.pairs += 1
    return Pair(prompt, chosen, rejected, pair.margin)


def _rendered(tokenizer: ModelTokenizer, prompt: list[dict], *completions: list[dict],
              ) -> tuple[str, ...] | str:
    """The prompt's text with the generation prompt, and what each completion adds to it."""
    if tokenizer.template is None:
        raise DataError(f"conversational preference records need a chat template and "
                        f"data.tokenizer {tokenizer.source!r} has none; set "
                        "data.chat_template (chatml, llama3, or a Jinja template)")
    template, special = tokenizer.template, tokenizer.special
    try:
        start = template.render(prompt, add_generation_prompt=True, special=special)
        answers = []
        for completion in completions:
            text = template.render([*prompt, *completion], special=special)
            if not text.startswith(start):
                return ("the chat template renders the prompt differently once an answer "
                        "follows it, so the answer cannot be split off; use another template")
            answers.append(text[len(start):].rstrip())
    except DataError as error:
        return str(error)
    return (start, *answers)


def _messages(value: object, needs_assistant: bool) -> str | None:
    """What is wrong with a list of messages (None: nothing); a prompt needs no assistant."""
    if not needs_assistant and isinstance(value, list):
        value = [*value, {"role": "assistant", "content": ""}]
    checked = check_messages(value)
    return checked if isinstance(checked, str) else None


def _shared_messages(chosen: list[dict], rejected: list[dict]) -> list[dict]:
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared]


def _text_prompt(chosen: str, rejected: str) -> tuple[str, int]:
    """The start two texts share, ended before the space that starts the answers."""
    cut = 0
    while cut < min(len(chosen), len(rejected)) and chosen[cut] == rejected[cut]:
        cut += 1
    if cut < min(len(chosen), len(rejected)) and cut and chosen[cut - 1] == " ":
        cut -= 1
    return chosen[:cut], cut
