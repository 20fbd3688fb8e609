"""The tokenizer a run trained with, kept in its run directory (``tokenizer/``).

A run reads text through the tokenizer its ``data`` section names, a path outside the run. The
run keeps the files that make that tokenizer, so that sampling, ``trainrun.load_tokenizer``,
export and a reward model read the very token ids it trained on wherever the run directory
goes, and a resume on another tokenizer is refused rather than encoding the rest of the run
with it. The folder is laid out as a Hugging Face tokenizer folder:

- a text run with ``data.tokenizer``: its ``tokenizer.json``, byte for byte;
- a run on records (and so preference, reward and reinforcement runs): ``tokenizer.json`` (the
  ``tokenizers`` library's own serialization), ``tokenizer_config.json`` (the special tokens and
  the chat template, ``data.chat_template`` applied) and ``generation_config.json`` (the ids
  that end an answer), which ``model_tokenizer.load`` reads back as the same tokenizer.

A run from before the folder was kept has none; its readers fall back to ``data.tokenizer``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from trainrun.config import RecordsData, TextData
from trainrun.errors import UserError
from trainrun.storage import location
from trainrun.storage.location import Location

if TYPE_CHECKING:  # the tokenizers stack is imported only where a tokenizer is read
    from trainrun.data.model_tokenizer import ModelTokenizer

FOLDER = "tokenizer"  # in the run directory
TOKENIZER_JSON = "tokenizer.json"


def tokenizer_files(data: Any) -> dict[str, str] | None:
    """The files (name -> text) that hold the tokenizer ``data`` is read with; None for data
    read without one (bytes in windows, arrays, digits)."""
    if isinstance(data, TextData):
        if data.tokenizer is None:
            return None
        return {TOKENIZER_JSON: location.location(data.tokenizer).read_text(encoding="utf-8")}
    if isinstance(data, RecordsData):
        from trainrun.data import model_tokenizer

        return _records_files(model_tokenizer.of_records(data))
    return None


def _records_files(found: ModelTokenizer) -> dict[str, str]:
    settings: dict[str, Any] = dict(found.special)
    if found.template is not None:
        settings["chat_template"] = found.template.source
    return {TOKENIZER_JSON: found.tokenizer.to_str(),
            "tokenizer_config.json": _json(settings),
            "generation_config.json": _json({"eos_token_id": list(found.stop_ids)})}


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def kept_folder(run: Location) -> Location | None:
    """The folder holding the tokenizer ``run`` keeps; None for a run that keeps none. The
    folder, or a file in it, that is a symbolic link was not written by trainrun: refused,
    not read through (a sample, an eval or an export would use another tokenizer than the
    run's, or carry out whatever the link names)."""
    folder = run / FOLDER
    if folder.is_symlink():
        _refuse_link(folder)
    if not (folder / TOKENIZER_JSON).is_file():
        return None
    if folder.local_path is not None:  # links exist only on a file system, not in a bucket
        for name in sorted(folder.list_names()):
            if (folder / name).is_symlink():
                _refuse_link(folder / name)
    return folder


def _refuse_link(path: Location) -> None:
    raise UserError(f"{path} is a symbolic link where the run keeps the tokenizer it trained "
                    "with, not what trainrun wrote; replace the link with a copy of what it "
                    "points to")


def kept_files(run: Location) -> dict[str, str] | None:
    """The tokenizer files ``run`` keeps (name -> text); None for a run that keeps none."""
    folder = kept_folder(run)
    return None if folder is None else _files_in(folder)


def _files_in(folder: Location) -> dict[str, str]:
    return {name: (folder / name).read_text(encoding="utf-8")
            for name in sorted(folder.list_names()) if (folder / name).is_file()}


def run_records_tokenizer(run: Location, data: RecordsData,
                          chat_template: str | None = None) -> ModelTokenizer:
    """The tokenizer a run on records trained with: the one it keeps, else (a run from before
    it kept one) what its ``data.tokenizer`` and ``data.chat_template`` name now.
    ``chat_template``: a built-in template's name or Jinja text, in place of the run's."""
    from trainrun.data import model_tokenizer

    folder = kept_folder(run)
    if folder is not None:
        return model_tokenizer.load(str(folder), chat_template)
    return model_tokenizer.load(data.tokenizer or model_tokenizer.BYTES,
                                chat_template or data.chat_template)


def records_as_trained(run: Location, data: Any) -> Any:
    """``data``, a run's section, reading its records through the tokenizer and chat template
    the run keeps: ``data`` itself while its ``data.tokenizer`` and ``data.chat_template`` still
    make that tokenizer (or where the run keeps none, or reads no records), else naming the kept
    folder by its absolute path."""
    folder = kept_folder(run)
    if not isinstance(data, RecordsData) or folder is None:
        return data
    try:
        if tokenizer_files(data) == _files_in(folder):
            return data
    except (UserError, OSError):  # what it names is gone or no longer reads
        pass
    return data.model_copy(update={"tokenizer": str(folder.absolute()), "chat_template": None})


def run_text_tokenizer(run: Location, data: TextData) -> str | None:
    """Where a text run's ``tokenizer.json`` is read from: the copy it keeps, else its
    ``data.tokenizer``; None for a byte-level run."""
    if data.tokenizer is None:
        return None
    folder = kept_folder(run)
    return str(folder / TOKENIZER_JSON) if folder is not None else data.tokenizer
