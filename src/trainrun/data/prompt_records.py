"""Prompt records for reinforcement learning (the ``rl`` section): the prompts completions are
drawn for, and the fields the rewards read, from JSONL or Parquet files (``records.py``) or a
synthetic task (``tasks.py``).

A record's prompt is its ``prompt`` field (``data.fields.prompt``): a text, encoded as a text's
start, or a list of messages, rendered with the chat template and a generation prompt. A chat
record (``messages``) asks for its last assistant turn: the turns before it are the prompt and
that turn's content is the record's ``answer`` (unless it has one). Every other field is handed
to the rewards as it is. Every ``round(1 / eval_fraction)``-th usable record is held out (or
``data.eval_paths`` holds them); a record that cannot be used is refused in one line naming
its file and line, or, with ``data.bad_records=skip``, left out and counted.

``completion_texts`` and ``score_completions`` give the rewards a prompt's completions as a
run's rollouts and ``trainrun eval`` both score them: as TRL hands them, a text prompt and its
completions as texts, a prompt of messages as its messages and each completion as a list of one
assistant message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from trainrun.config import RecordsData
from trainrun.data import model_tokenizer, rewards
from trainrun.data.chat import check_messages
from trainrun.data.errors import DataError
from trainrun.data.examples import require_template
from trainrun.data.record_rows import Source
from trainrun.data.records import Located, read_records
from trainrun.data.text import corpus_files

ANSWER = "answer"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: where its record is, its token ids (int32), its text as the model reads it
    (a conversation rendered by the template), the record's other fields, and its messages
    (None for a text prompt): the rewards get them, and each completion as a message."""

    where: str
    ids: np.ndarray
    text: str
    fields: dict[str, Any]
    messages: list[dict[str, Any]] | None = None


@dataclasses.dataclass(frozen=True)
class PromptRecords:
    """The training and held-out prompts, the records left out, and each file read with its
    content fingerprint."""

    train: list[Prompt]
    eval: list[Prompt]
    skipped: list[str]
    files: dict[str, str]


def prompt_records(cfg: RecordsData, longest: int) -> PromptRecords:
    """The prompts of ``cfg``'s records, each at most ``longest`` tokens (a longer one is a
    bad record). No training prompt at all is a DataError."""
    tokenizer = model_tokenizer.of_records(cfg)
    source = (Source(synthetic=cfg.synthetic) if cfg.synthetic else
              Source(files=tuple(corpus_files(cfg.paths))))
    every = 0 if cfg.eval_paths or not cfg.eval_fraction else round(1 / cfg.eval_fraction)
    skipped: list[str] = []
    train, held = _split(cfg, tokenizer, source, every, longest, skipped)
    files = dict(source.fingerprints())
    if cfg.eval_paths:
        held_source = Source(files=tuple(corpus_files(cfg.eval_paths)))
        held = _split(cfg, tokenizer, held_source, -1, longest, skipped)[1]
        files.update(held_source.fingerprints())
    if not train:
        raise DataError(f"no prompt to draw completions for in {source.describe()} "
                        f"({len(skipped)} records left out); give records with a "
                        f"{cfg.fields.prompt!r} or {cfg.fields.messages!r} field")
    return PromptRecords(train, held, skipped, files)


def _split(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, source: Source,
           every: int, longest: int, skipped: list[str]) -> tuple[list[Prompt], list[Prompt]]:
    """The usable records' prompts, every ``every``-th one held out (-1: all, 0: none)."""
    splits: tuple[list[Prompt], list[Prompt]] = ([], [])
    for where, record in _located(cfg, source):
        found = (record if isinstance(record, str) else
                 _prompt(cfg, tokenizer, where, record, longest))
        if isinstance(found, str):
            if cfg.bad_records == "refuse":
                raise DataError(f"record {where}: {found}; fix or remove it, or set "
                                "data.bad_records=skip to leave bad records out (they are "
                                "counted)")
            skipped.append(f"{where}: {found}")
            continue
        usable = len(splits[0]) + len(splits[1])
        held = every == -1 or (every > 0 and usable % every == every - 1)
        splits[int(held)].append(found)
    return splits


def _located(cfg: RecordsData, source: Source) -> Iterator[Located]:
    """Every record of ``source`` with all its fields (the rewards may read any of them)."""
    if source.synthetic:
        yield from source.records(cfg)
        return
    for file in source.files:
        yield from read_records(file)


def _prompt(cfg: RecordsData, tokenizer: model_tokenizer.ModelTokenizer, where: str,
            record: dict[str, Any], longest: int) -> Prompt | str:
    """The record's prompt, or what is wrong with it."""
    names = cfg.fields
    fields = {key: value for key, value in record.items()
              if key not in (names.prompt, names.messages)}
    if names.prompt in record:
        asked = record[names.prompt]
    elif names.messages in record:
        asked = record[names.messages]
        if isinstance(asked, list) and asked and isinstance(asked[-1], dict) and (
                asked[-1].get("role") == "assistant"):
            fields.setdefault(ANSWER, asked[-1].get("content"))
            asked = asked[:-1]
    else:
        return f"has neither a {names.prompt!r} nor a {names.messages!r} field (set data.fields)"
    messages = None
    if isinstance(asked, str):
        text, special = asked, True
    else:
        # the turns are checked as a conversation that an answer would complete
        problem = check_messages([*asked, {"role": "assistant", "content": ""}]
                                 if isinstance(asked, list) and asked else asked)
        if isinstance(problem, str):
            return problem
        turns = [{"role": t["role"], "content": t["content"]} for t in asked]
        text = require_template(tokenizer).render(turns, add_generation_prompt=True,
                                                  special=tokenizer.special)
        special, messages = False, list(asked)
    ids = np.asarray(tokenizer.tokenizer.encode(text, add_special_tokens=special).ids, np.int32)
    if ids.size == 0:
        return "its prompt is empty"
    if ids.size > longest:
        return (f"its prompt is {ids.size} tokens, more than the {longest} that leave room for "
                "a completion in data.seq_len (raise it, or lower rl.completion_tokens)")
    return Prompt(where, ids, text, fields, messages)


def completion_texts(tokenizer: model_tokenizer.ModelTokenizer, ids: Sequence[np.ndarray],
                     cut: Callable[[str], str] = lambda text: text) -> list[str]:
    """Each completion's text as the rewards read it: its tokens decoded without a final stop
    id, then ``cut`` (at a stop string)."""
    stops = set(tokenizer.stop_ids)
    return [cut(tokenizer.tokenizer.decode(
        (row[:-1] if row.size and int(row[-1]) in stops else row).tolist())) for row in ids]


def score_completions(found: Sequence[rewards.Reward], asked: Sequence[Prompt],
                      texts: Sequence[str], ids: Sequence[np.ndarray],
                      progress: rewards.RunProgress | None = None) -> np.ndarray:
    """``[rewards, completions]``: each reward of each completion (NaN where it returned None),
    ``asked[i]`` the prompt of completion ``i``, with its record's fields (None where another
    record has a field it lacks), ``completion_ids`` and ``progress`` as ``trainer_state``.
    The rewards get a prompt with messages and its completion as TRL hands them: the messages,
    and ``[{"role": "assistant", "content": text}]``."""
    names = sorted({name for prompt in asked for name in prompt.fields})
    fields: dict[str, list[Any]] = {name: [p.fields.get(name) for p in asked] for name in names}
    fields["completion_ids"] = [row.tolist() for row in ids]
    prompts = [p.text if p.messages is None else p.messages for p in asked]
    completions = [text if p.messages is None else [{"role": "assistant", "content": text}]
                   for p, text in zip(asked, texts, strict=True)]
    return rewards.score(found, prompts, completions, fields, [p.where for p in asked],
                         progress)
