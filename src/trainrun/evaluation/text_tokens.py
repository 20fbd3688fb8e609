"""``trainrun.load_tokenizer(path)``: text to the token ids of the model ``trainrun.load(path)``
reads, and back, whichever form the model is in:

- a run directory: the tokenizer it was trained with: one token per byte for a text run without
  ``data.tokenizer``, else the tokenizer it keeps (``tokenizer/``: a tokenized text run's
  ``tokenizer.json``, a run on records' tokenizer with its chat template), or for a run from
  before it kept one what its ``data.tokenizer`` names;
- a Hugging Face model directory: its ``tokenizer.json``, special tokens and chat template;
- a PEFT adapter directory: its own tokenizer files, else its base model's.

A tokenizer's ids never exceed the model's vocabulary, which may be larger (rounded up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainrun import rundir
from trainrun.data.kept_tokenizer import run_records_tokenizer, run_text_tokenizer
from trainrun.errors import UserError
from trainrun.storage import location
from trainrun.storage.location import Location

if TYPE_CHECKING:  # the tokenizers stack is imported only where a tokenizer is read
    from trainrun.data.chat import ChatTemplate
    from trainrun.data.model_tokenizer import ModelTokenizer

BYTES = "bytes"


class TokenizerError(UserError):
    """A path whose tokenizer cannot be found or read; one line, exit 2 at the CLI."""


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """Text to token ids and back, with the ids and template a model's text is framed with.

    name: what the tokenizer is (``bytes``, or the file or directory it was read from).
    bos_id: the id that begins a text (None: the tokenizer has none).
    eos_id: the id that ends a text (None: none; a byte-level text run has none).
    stop_ids: ids that end a generated answer (the end of a text, the end of a turn).
    template: the chat template (None: the tokenizer has none).
    special: the special tokens by name (``bos_token``, ``eos_token``, ...), as chat templates
        see them.
    library: the ``tokenizers.Tokenizer`` (None: one token per byte).
    """

    name: str
    bos_id: int | None
    eos_id: int | None
    stop_ids: tuple[int, ...]
    template: ChatTemplate | None
    special: dict[str, str]
    library: Any = None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """``text``'s token ids; ``special``: with what the tokenizer adds around a text (a
        begin-of-text id, where its post-processor puts one)."""
        if self.library is None:
            return list(text.encode("utf-8"))
        return list(self.library.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int], *, special: bool = False) -> str:
        """The text of ``ids``; ``special``: with the special tokens' text (by default left
        out, as Hugging Face's ``skip_special_tokens``)."""
        ids = [int(i) for i in ids]
        if self.library is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return str(self.library.decode(ids, skip_special_tokens=not special))

    @property
    def size(self) -> int:
        """Token ids run from 0 to ``size - 1``."""
        if self.library is None:
            return 256
        return int(self.library.get_vocab_size(with_added_tokens=True))

    @property
    def prefix_id(self) -> int:
        """The id a text with nothing before it is read after: the begin-of-text id, else the
        end-of-text id, else (bytes without either) a newline."""
        for token in (self.bos_id, self.eos_id):
            if token is not None:
                return token
        return self.encode("\n", special=False)[-1]


def load_tokenizer(path: str | Path, *, chat_template: str | None = None) -> TextTokenizer:
    """The tokenizer of the model at ``path`` (what ``trainrun.load(path)`` reads); a run
    directory may be on object storage. ``chat_template``: a built-in template's name
    (``chatml``, ``llama3``) or Jinja text, in place of the tokenizer's own."""
    run = location.location(path)  # where the path enters
    folder = run.local_path
    if (run / rundir.CONFIG).is_file():
        return _run_tokenizer(run, chat_template)
    if folder is None:
        raise TokenizerError(f"{run} holds no trainrun run (no {rundir.CONFIG}); on object "
                             "storage a run directory's tokenizer is read: give one, or the "
                             "local path of a Hugging Face or adapter directory")
    return _model_dir_tokenizer(run, chat_template)


def _run_tokenizer(run: Location, chat_template: str | None) -> TextTokenizer:
    from trainrun.checkpointing.reader import saved_config
    from trainrun.config import RecordsData, TextData

    data = saved_config(run).data
    if isinstance(data, RecordsData):
        return _text_tokenizer(run_records_tokenizer(run, data, chat_template))
    if not isinstance(data, TextData):
        raise TokenizerError(f"{run} trains on data.kind={data.kind}, which is not text; a "
                             "tokenizer is read from runs on data.kind=text or records")
    source = run_text_tokenizer(run, data)
    if source is not None:
        return _model_tokenizer(source, chat_template)
    template = None
    if chat_template is not None:
        from trainrun.data.chat import ChatTemplate

        template = ChatTemplate.named(chat_template, "chat_template")
    return TextTokenizer(BYTES, None, None, (), template, {})


def _model_dir_tokenizer(path: Location, chat_template: str | None) -> TextTokenizer:
    from trainrun.models import peft

    model_config = path / "config.json"  # where the model's own bos and eos ids are
    if (path / peft.ADAPTER_CONFIG).is_file():
        from trainrun.checkpointing.init_from import _adapter_base

        base = _adapter_base(path)
        if base.local_path is not None:
            model_config = base / "config.json"
        if not (path / "tokenizer.json").is_file():
            if base.local_path is None:
                raise TokenizerError(f"{path} has no tokenizer.json and its base model {base} "
                                     "is on object storage; copy the base's tokenizer files "
                                     f"into {path}")
            path = base
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path} has no tokenizer.json; save the model's tokenizer there "
                             "(tokenizer.save_pretrained) or give a directory that has one")
    found = _model_tokenizer(str(path), chat_template)
    # No tokenizer_config.json naming them (an export of a tokenized run): the model's own ids
    ids = _config_ids(model_config)
    bos_id = found.bos_id if found.bos_id is not None else ids.get("bos_token_id")
    eos_id = found.eos_id if found.eos_id is not None else ids.get("eos_token_id")
    special = dict(found.special)
    for name, token in (("bos_token", bos_id), ("eos_token", eos_id)):
        text = None if token is None else found.library.id_to_token(token)
        if name not in special and text is not None:
            special[name] = text
    stops = found.stop_ids if eos_id is None or eos_id in found.stop_ids else (
        *found.stop_ids, eos_id)
    return dataclasses.replace(found, bos_id=bos_id, eos_id=eos_id, stop_ids=stops,
                               special=special)


def _config_ids(file: Location) -> dict[str, int]:
    """The whole-number ``bos_token_id`` and ``eos_token_id`` of a model's config.json."""
    import json

    try:
        text = file.model_file(TokenizerError).read_text(encoding="utf-8")
        config = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError):
        return {}  # the model's loader reports an unreadable config.json
    if not isinstance(config, dict):
        return {}
    return {name: value for name in ("bos_token_id", "eos_token_id")
            if isinstance(value := config.get(name), int) and not isinstance(value, bool)}


def _model_tokenizer(source: str, chat_template: str | None) -> TextTokenizer:
    """A record source's tokenizer (``trainrun.data.model_tokenizer``), as a TextTokenizer."""
    from trainrun.data import model_tokenizer

    return _text_tokenizer(model_tokenizer.load(source, chat_template))


def _text_tokenizer(found: ModelTokenizer) -> TextTokenizer:
    lib = found.tokenizer
    bos = found.special.get("bos_token")
    bos_id = None if bos is None else lib.token_to_id(bos)
    return TextTokenizer(found.source, bos_id, found.eos_id, found.stop_ids, found.template,
                         dict(found.special), lib)
