"""Held-out answers generated and scored: the questions held-out chat and completion records
ask (each assistant turn after the turns before it; each completion after its prompt), the
answers a model's params give them, and the fraction that match the records' own
(``exact_match``, and ``normalised_match`` after whitespace and case are evened out).
``trainrun eval`` and evaluation during training (``eval.generate``) both use them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from trainrun.config import RecordsData, TransformerModel

if TYPE_CHECKING:  # the decoder is imported only where answers are generated
    from trainrun.program.decode import HeadLayout

PyTree = Any
Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Question:
    """One answer to generate: the turns before it (chat) or the prompt (completion), and the
    answer the record holds."""

    prompt: list[dict[str, str]] | str
    expected: str
    where: str


def normalised(text: str) -> str:
    """The text as ``normalised_match`` compares it: whitespace runs as one space, the ends
    stripped, case folded."""
    return " ".join(text.split()).casefold()


def answer_scores(expected: Sequence[str], produced: Sequence[str]) -> dict[str, float]:
    """``exact_match`` and ``normalised_match``: the fraction of answers that equal the
    expected ones, as they are and normalised."""
    pairs = list(zip(expected, produced, strict=True))
    if not pairs:
        return {}
    return {"exact_match": sum(e == p for e, p in pairs) / len(pairs),
            "normalised_match": sum(normalised(e) == normalised(p) for e, p in pairs)
            / len(pairs)}


def questions(data: RecordsData, limit: int = 0) -> list[Question]:
    """The answers held-out records ask for, in the split's order (``limit``: the first so
    many; 0: all): each assistant turn of a chat record after the turns before it, and each
    completion record's completion after its prompt. Text records ask for none."""
    from trainrun.data import model_tokenizer
    from trainrun.data.record_rows import held_out_sources, split_records

    tokenizer = model_tokenizer.of_records(data)
    out: list[Question] = []
    for source, every in held_out_sources(data):
        for split, where, record, form in split_records(data, tokenizer, source, every):
            if split != "eval":
                continue
            out += _asked(record, form, data, where)
            if limit and len(out) >= limit:
                return out[:limit]
    return out


def _asked(record: dict[str, Any], form: str, data: RecordsData, where: str) -> Iterator[Question]:
    fields = data.fields
    if form == "completion":
        yield Question(record[fields.prompt], record[fields.completion], where)
    elif form == "chat":
        turns = [{"role": t["role"], "content": t["content"]} for t in record[fields.messages]]
        for i, turn in enumerate(turns):
            if turn["role"] == "assistant" and i > 0:
                yield Question(turns[:i], turn["content"], f"{where} turn {i + 1}")


def answer_all(model: TransformerModel, compute: str, data: RecordsData, params: PyTree,
               asked: Sequence[Question], tokens: int, *, temperature: float = 0.0,
               seed: int = 0, batch_size: int = 16,
               progress: Progress = lambda line: None, head: HeadLayout | None = None,
               ) -> list[str]:
    """Each question's generated answer, ``batch_size`` at a time (one compiled program);
    head: the decoder's head layout (``program/decode.py``; None: its default)."""
    from trainrun.data import model_tokenizer
    from trainrun.program.decode import chat_replies, complete, head_as_trained

    found = model_tokenizer.of_records(data)
    produced: dict[int, str] = {}
    step = batch_size * 8  # a progress line every few batches
    answerers: tuple[tuple[type, Callable[..., list[str]]], ...] = (
        (list, chat_replies), (str, complete))  # chat turns; a completion's prompt
    for kind, answer in answerers:
        members = [i for i, q in enumerate(asked) if isinstance(q.prompt, kind)]
        for first in range(0, len(members), step):
            part = members[first:first + step]
            prompts: list[Any] = [asked[i].prompt for i in part]  # all of ``kind``
            produced.update(zip(part, answer(
                model, params, found, prompts, tokens,
                temperature=temperature, seed=seed + first, compute=compute,
                batch_size=batch_size, head=head or head_as_trained), strict=True))
            progress(f"answers {len(produced)}/{len(asked)}")
    return [produced[i] for i in range(len(asked))]


def answer_scorer(config: Any,
                  head: HeadLayout | None = None) -> Callable[[PyTree], dict[str, float]]:
    """params -> ``exact_match`` and ``normalised_match`` of the first ``eval.generate``
    held-out answers (greedy, at most ``eval.answer_tokens`` each), for evaluation in
    training; the questions are read once, here. head: as ``answer_all``'s."""
    from trainrun.checkpointing.run_context import run_model

    data = config.data
    assert isinstance(data, RecordsData)
    model = run_model(config)  # answers within the architecture's context, as `eval` gives
    asked = questions(data, config.eval.generate)
    if not asked:
        from trainrun.data.errors import DataError

        raise DataError(f"eval.generate={config.eval.generate}: the held-out records ask no "
                        "answer (text records have none); use chat or completion records, or "
                        "set eval.generate=0")
    expected = [q.expected for q in asked]

    def scores(params: PyTree) -> dict[str, float]:
        produced = answer_all(model, config.precision.compute, data, params, asked,
                              config.eval.answer_tokens,
                              batch_size=config.eval.batch_size or data.batch_size,
                              head=head)
        return answer_scores(expected, produced)

    return scores
