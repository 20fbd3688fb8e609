"""The tokenizer a record source is encoded with, with what instruction data needs beside it:
its special tokens, the ids that end a document and a turn, and its chat template.

``data.tokenizer`` names one of:

- ``bytes``: a tokenizer built here, one token per byte (ids 0-255) plus ``<|endoftext|>``
  (put before each document and after each text), ``<|im_start|>`` and ``<|im_end|>`` (the
  ``chatml`` template's turn markers). Nothing to download or train: a small model learns a
  character-level task with it on a CPU.
- a Hugging Face model directory: its ``tokenizer.json`` (read by the ``tokenizers`` library),
  the special tokens ``tokenizer_config.json`` names (``bos_token``, ``eos_token``, ...), its
  chat template (``tokenizer_config.json`` or ``chat_template.jinja``) and the end-of-turn ids of
  ``generation_config.json``. A file of it that is a symbolic link out of the directory (or,
  for a hub snapshot, out of its repository's folder) is refused on one line naming the link.
- a ``tokenizer.json`` file alone (no template; ``<|endoftext|>`` ends a text when it has one).

Either may be on object storage (``gs://``, ``s3://``), its files read through the storage
layer.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from trainrun.data.chat import CHATML, ChatTemplate
from trainrun.data.errors import DataError
from trainrun.data.tokenizer import DOCUMENT_TOKEN, byte_alphabet, library
from trainrun.storage import location

Location = location.Location

BYTES = "bytes"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"  # the chatml template's
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")  # templates' turn ends


@dataclasses.dataclass(frozen=True)
class ModelTokenizer:
    """A ``tokenizers.Tokenizer`` and the facts about it that records need.

    special: the special tokens by name (``bos_token``, ``eos_token``, ...), as chat templates
        see them.
    eos_id: appended after a text or a completion, so the model learns to stop (None: none).
    stop_ids: ids that end a generated answer (the end of a turn, the end of a text).
    template: the chat template (None: the tokenizer has none).
    source: what ``data.tokenizer`` named, for messages.
    """

    tokenizer: Any
    special: dict[str, str]
    eos_id: int | None
    stop_ids: tuple[int, ...]
    template: ChatTemplate | None
    source: str

    @property
    def size(self) -> int:
        """Token ids run from 0 to ``size - 1``."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def fingerprint(self) -> str:
        """Everything that decides the token ids of a record, as text (a cache key's part)."""
        return json.dumps({"tokenizer": self.tokenizer.to_str(), "special": self.special,
                           "eos": self.eos_id,
                           "template": None if self.template is None else self.template.source},
                          sort_keys=True)


def of_records(data: Any) -> ModelTokenizer:
    """The tokenizer and chat template a ``data.kind=records`` section reads its records with."""
    return load(data.tokenizer or BYTES, data.chat_template)


def load(source: str, chat_template: str | None = None) -> ModelTokenizer:
    """The tokenizer ``source`` names (``bytes``, a model directory or a ``tokenizer.json``),
    with ``chat_template`` (a built-in name or Jinja text) in place of its own template."""
    if source == BYTES:
        found = byte_tokenizer()
    else:
        path = location.location(source)
        if path.is_file():
            found = _tokenizer_file(path, source)
        elif path.is_dir():
            found = _model_dir(path, source)
        elif path.local_path is None:
            raise DataError(f"data.tokenizer: {path.missing_line('object or folder')}; "
                            "give a Hugging Face model directory, a tokenizer.json, or 'bytes'")
        else:
            raise DataError(f"data.tokenizer {source!r} not found; give a Hugging Face model "
                            "directory, a tokenizer.json, or 'bytes'")
    if chat_template is not None:
        found = dataclasses.replace(found, template=ChatTemplate.named(chat_template))
    return dataclasses.replace(found, stop_ids=_with_turn_ends(found))


def _with_turn_ends(found: ModelTokenizer) -> tuple[int, ...]:
    """The stop ids and the end-of-turn tokens of the template that the tokenizer has."""
    stops = list(found.stop_ids)
    if found.template is not None:
        for token in TURN_ENDS:
            token_id = found.tokenizer.token_to_id(token)
            if token in found.template.source and token_id is not None and token_id not in stops:
                stops.append(token_id)
    return tuple(stops)


def byte_tokenizer() -> ModelTokenizer:
    """One token per byte (id = the byte) and three special tokens after them."""
    lib = library()
    alphabet = byte_alphabet()
    vocab = {alphabet[byte]: byte for byte in range(256)}
    tokenizer = lib.Tokenizer(lib.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
    tokenizer.decoder = lib.decoders.ByteLevel()
    tokenizer.add_special_tokens([DOCUMENT_TOKEN, TURN_START, TURN_END])
    document = tokenizer.token_to_id(DOCUMENT_TOKEN)
    tokenizer.post_processor = lib.processors.TemplateProcessing(
        single=f"{DOCUMENT_TOKEN} $A", special_tokens=[(DOCUMENT_TOKEN, document)])
    return ModelTokenizer(
        tokenizer=tokenizer, special={"bos_token": DOCUMENT_TOKEN, "eos_token": DOCUMENT_TOKEN},
        eos_id=document, stop_ids=(document,),
        template=ChatTemplate(CHATML, "built-in chatml"), source=BYTES)


def _read_tokenizer(file: Location, source: str) -> Any:
    lib = library()
    local = file.local_path
    text = _text(file, source) if local is None else None
    try:
        return lib.Tokenizer.from_file(str(local)) if text is None else lib.Tokenizer.from_str(text)
    except Exception as err:  # the library raises a bare Exception for bad JSON
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data.tokenizer {source!r}: cannot read {file.name} as a tokenizer of "
                        f"the tokenizers library ({first})") from None


def _text(file: Location, source: str) -> str:
    """A file of the tokenizer as UTF-8 text; unreadable is one line."""
    try:
        return file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"data.tokenizer {source!r}: cannot read {file.name} ({err}); restore "
                        "the file from the model's release") from None


def _tokenizer_file(file: Location, source: str) -> ModelTokenizer:
    tokenizer = _read_tokenizer(file, source)
    end = tokenizer.token_to_id(DOCUMENT_TOKEN)
    special = {} if end is None else {"eos_token": DOCUMENT_TOKEN}
    return ModelTokenizer(tokenizer=tokenizer, special=special, eos_id=end,
                          stop_ids=() if end is None else (end,), template=None, source=source)


def _model_dir(path: Location, source: str) -> ModelTokenizer:
    file = (path / "tokenizer.json").model_file(DataError)
    if not file.is_file():
        raise DataError(f"data.tokenizer {source!r} has no tokenizer.json (a tokenizer saved by "
                        "an older transformers as vocab files alone is not read); save it with a "
                        "recent transformers, or name a tokenizer.json")
    tokenizer = _read_tokenizer(file, source)
    settings = _json_object(path / "tokenizer_config.json", source)
    special = {}
    for name in SPECIAL_NAMES:
        value = settings.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            special[name] = value
    eos = special.get("eos_token")
    eos_id = None if eos is None else tokenizer.token_to_id(eos)
    stops = [] if eos_id is None else [eos_id]
    generation = _json_object(path / "generation_config.json", source).get("eos_token_id")
    for token in generation if isinstance(generation, list) else [generation]:
        if isinstance(token, int) and token not in stops:
            stops.append(token)
    return ModelTokenizer(tokenizer=tokenizer, special=special, eos_id=eos_id,
                          stop_ids=tuple(stops), template=ChatTemplate.from_model_dir(path),
                          source=source)


def _json_object(file: Location, source: str) -> dict[str, Any]:
    """The JSON object in ``file`` ({} when there is no file)."""
    if not file.model_file(DataError).is_file():
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"data.tokenizer {source!r}: {file.name} is not readable JSON ({err}); "
                        "restore the file from the model's release") from None
    if not isinstance(value, dict):
        raise DataError(f"data.tokenizer {source!r}: {file.name} is not a JSON object; restore "
                        "the file from the model's release")
    return value
