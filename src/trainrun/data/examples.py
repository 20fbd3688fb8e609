"""A record as one training example: its token ids and, beside them, which tokens the loss
counts as targets.

- ``text``: the tokenizer's encoding of the text with its special tokens (a document token or
  a ``bos``), then ``eos``; every token counts.
- ``completion``: the prompt encoded as a text's start, the completion after it, then ``eos``;
  the completion and ``eos`` count, so the model learns the answer and where it ends.
- ``chat``: the messages rendered with the chat template and encoded as ``transformers``'
  ``apply_chat_template`` encodes them (no special tokens added: the template writes them);
  the assistant turns count (``chat.py`` says what a turn holds).

With ``loss=all`` every token of every format counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainrun.config import RecordFields
from trainrun.data.chat import ChatTemplate, check_messages, encode_chats
from trainrun.data.errors import DataError
from trainrun.data.model_tokenizer import ModelTokenizer
from trainrun.data.records import describe

Example = tuple[np.ndarray, np.ndarray]  # token ids (uint32); loss mask (bool), one per token


def detect_format(record: Mapping[str, Any], fields: RecordFields) -> str | None:
    """``chat``, ``completion`` or ``text`` by the fields a record has (None: none of them)."""
    if fields.messages in record:
        return "chat"
    if fields.prompt in record and fields.completion in record:
        return "completion"
    if fields.text in record:
        return "text"
    return None


def expected_fields(form: str, fields: RecordFields) -> list[str]:
    return {"chat": [fields.messages], "completion": [fields.prompt, fields.completion],
            "text": [fields.text]}[form]


def problem(record: Mapping[str, Any], form: str, fields: RecordFields) -> str | None:
    """What makes ``record`` unusable as a ``form`` record (None: nothing)."""
    for name in expected_fields(form, fields):
        if name not in record:
            present = ", ".join(sorted(record)) or "none"
            return f"no {name!r} field (its fields: {present})"
        value = record[name]
        if form == "chat":
            checked = check_messages(value)
            if isinstance(checked, str):
                return f"field {name!r}: {checked}"
        elif not isinstance(value, str):
            return f"field {name!r} is {describe(value)}, not a string"
    return None


def require_template(tokenizer: ModelTokenizer) -> ChatTemplate:
    """The tokenizer's chat template; a DataError when it has none."""
    if tokenizer.template is None:
        raise DataError(f"chat records need a chat template and data.tokenizer "
                        f"{tokenizer.source!r} has none; set data.chat_template (chatml, "
                        "llama3, or a Jinja template)")
    return tokenizer.template


def encode_examples(records: Sequence[Mapping[str, Any]], form: str, fields: RecordFields,
                    tokenizer: ModelTokenizer, loss: str) -> list[Example | str]:
    """Records already checked by ``problem`` as examples, in order; a chat record its
    template refuses (roles out of order, say) gives what is wrong with it in its place."""
    lib = tokenizer.tokenizer
    end = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    examples: list[Example | str] = []
    if form == "text":
        for encoding in lib.encode_batch([r[fields.text] for r in records],
                                         add_special_tokens=True):
            ids = [*encoding.ids, *end]
            examples.append((np.asarray(ids, np.uint32), np.ones(len(ids), bool)))
    elif form == "completion":
        prompts = lib.encode_batch([r[fields.prompt] for r in records], add_special_tokens=True)
        answers = lib.encode_batch([r[fields.completion] for r in records],
                                   add_special_tokens=False)
        for prompt, answer in zip(prompts, answers, strict=True):
            ids = [*prompt.ids, *answer.ids, *end]
            mask = np.zeros(len(ids), bool)
            mask[len(prompt.ids):] = True
            examples.append((np.asarray(ids, np.uint32), mask))
    else:
        chats = encode_chats(lib, require_template(tokenizer),
                             [record[fields.messages] for record in records], tokenizer.special)
        for chat in chats:
            examples.append(str(chat) if isinstance(chat, DataError) else chat)
    if loss == "all":
        examples = [example if isinstance(example, str) else
                    (example[0], np.ones(example[0].size, bool)) for example in examples]
    return examples
