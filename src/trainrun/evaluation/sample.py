"""Text from a trained language model: ``trainrun sample RUN_DIR --prompt "def "``, or the
answer to a chat turn: ``trainrun sample RUN_DIR --chat "question"``, or to each conversation
of a file (``--file``). The decoding itself is ``program/decode.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainrun.checkpointing.reader import saved_config
from trainrun.config import RecordsData, TextData, TransformerModel
from trainrun.data.kept_tokenizer import run_records_tokenizer, run_text_tokenizer
from trainrun.fast import strategies
from trainrun.program.decode import (
    BATCH,
    Conversation,
    HeadLayout,
    SampleError,
    chat_replies,
    generate,
    require_settings,
)
from trainrun.storage import location

if TYPE_CHECKING:  # the tokenizers stack is imported only where a run on records is sampled
    from trainrun.data.model_tokenizer import ModelTokenizer

PyTree = Any

__all__ = ["SampleError", "chat_answers", "conversation", "read_conversations", "sample_run"]


def sample_run(run_dir: Path | str, prompt: str, tokens: int, *, temperature: float = 0.0,
               seed: int = 0, ema: bool = False, chat: str | None = None,
               system: str | None = None, context: int | None = None) -> str:
    """The prompt and ``tokens`` bytes generated from the latest checkpoint of an LM run (with
    ``ema``: from its params' moving average, ``optimizer.ema``), greedily at ``temperature``
    0, within the context of its architecture or ``context`` (``trainrun.load``'s; an answer
    that reaches it stops there, with a ``ContextWarning``). chat: a user turn, rendered with
    the run's chat template after ``system`` (a system prompt) when given; the answer alone
    is returned, ended at the turn's end."""
    require_settings(tokens, temperature, seed)
    for option, text in (("--prompt", prompt), ("--chat", chat), ("--system", system)):
        require_text(option, text)
    if chat is not None:
        return chat_answers(run_dir, [chat], tokens, temperature=temperature, seed=seed,
                            ema=ema, system=system, context=context)[0]
    if system is not None:
        raise SampleError("a system prompt (--system) goes with a chat turn: give --chat TEXT "
                          "or --file conversations.jsonl")
    trained = _trained(run_dir, ema, context=context)
    model, params, data = trained.model, trained.params, trained.data
    compute, head = trained.compute, strategies.chosen().decode_head()
    if trained.tokenizer is not None:
        return _sample_records(model, params, trained.tokenizer, prompt, tokens,
                               temperature=temperature, seed=seed, compute=compute, head=head)
    if data.tokenizer is not None:  # a tokenized run: text in and out through its own
        from trainrun.data.tokenizer import DOCUMENT_TOKEN, load

        tokenizer = load(data.tokenizer, data.vocab_size)
        # As in training, a document starts with the document token: the prompt opens one.
        ids = [tokenizer.token_to_id(DOCUMENT_TOKEN), *tokenizer.encode(prompt).ids]
        out = generate(model, params, np.array(ids, np.int32), tokens,
                       temperature=temperature, seed=seed, compute=compute, head=head)
        return tokenizer.decode(out[1:].tolist())
    out = generate(model, params, np.frombuffer(prompt.encode(), np.uint8), tokens,
                   temperature=temperature, seed=seed, compute=compute, head=head)
    return out.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def chat_answers(run_dir: Path | str, questions: Sequence[str | Conversation], tokens: int, *,
                 temperature: float = 0.0, seed: int = 0, ema: bool = False,
                 system: str | None = None, batch_size: int = BATCH,
                 context: int | None = None) -> list[str]:
    """The answers of a run on chat records (greedy at ``temperature`` 0), the checkpoint read
    once and the conversations decoded ``batch_size`` at a time by one program: to each
    question (a user turn, after ``system`` when given: what ``sample --chat`` prints) or
    conversation (its turns as records hold them, system prompt included; the answer follows
    the last turn). context: as ``sample_run``'s."""
    require_settings(tokens, temperature, seed)
    require_text("--system", system)
    conversations = [conversation(q, system) for q in questions]
    trained = _trained(run_dir, ema, chat=True, context=context)
    assert trained.tokenizer is not None
    return chat_replies(trained.model, trained.params, trained.tokenizer, conversations,
                        tokens, temperature=temperature, seed=seed, compute=trained.compute,
                        batch_size=batch_size, head=strategies.chosen().decode_head())


# The most of a conversations file read: a larger one, or one that never ends, is refused.
CONVERSATIONS_MAX_BYTES = 64 * 2**20


def require_text(option: str, text: str | None) -> None:
    """``text`` refused in one line naming ``option`` where it is no UTF-8 text: a lone
    surrogate, as Python holds command-line bytes that are not UTF-8."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise SampleError(f"{option} is not UTF-8 text (a byte that is not UTF-8, or a lone "
                          f"surrogate, at character {err.start}); give UTF-8 text") from None


def read_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSONL file of at most ``CONVERSATIONS_MAX_BYTES``, one
    ``{"messages": [...]}`` object a line (blank lines skipped); a line that is not one is
    refused naming the file and the line, and so is a larger file or one that never ends."""
    import json

    try:
        with Path(path).open("rb") as file:
            data = file.read(CONVERSATIONS_MAX_BYTES + 1)
        if len(data) > CONVERSATIONS_MAX_BYTES:
            raise SampleError(f"{path} holds more than {CONVERSATIONS_MAX_BYTES // 2**20} MiB "
                              "(or never ends); give a JSONL file of conversations within that")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SampleError(f"cannot read {path}: {err}; give a JSONL file of conversations"
                          .replace("\n", " ")) from None
    out: list[Conversation] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list):
            raise SampleError(f"{path} line {number} is not a JSON object with \"messages\" "
                              "(a list of turns); write one conversation a line")
        try:
            conversation(messages)
        except SampleError as err:
            raise SampleError(f"{path} line {number}: {err}") from None
        out.append(messages)
    if not out:
        raise SampleError(f"{path} holds no conversation; write one a line")
    return out


def conversation(question: str | Conversation, system: str | None = None) -> list[dict[str, str]]:
    """The chat turns a question stands for: a user turn (after ``system``), or a
    conversation's own turns, checked to end with a turn the model answers."""
    if isinstance(question, str):
        require_text("--chat", question)
        turns = [{"role": "user", "content": question}]
        return turns if system is None else [{"role": "system", "content": system}, *turns]
    turns = [dict(turn) if isinstance(turn, dict) else {} for turn in question]
    if not turns or any(set(t) != {"role", "content"} or not all(isinstance(v, str)
                                                                 for v in t.values())
                        for t in turns):
        raise SampleError("a conversation is a list of turns {\"role\": ..., \"content\": ...} "
                          "(text); give at least one")
    for number, turn in enumerate(turns, 1):
        for key, value in turn.items():
            require_text(f"turn {number}'s {key}", value)
    if turns[-1]["role"] == "assistant":
        raise SampleError("a conversation ends with the assistant's turn; end it with the turn "
                          "to answer (a user turn)")
    if system is not None:
        if turns[0]["role"] == "system":
            raise SampleError("a conversation has its own system prompt and --system gives "
                              "another; drop one of them")
        turns = [{"role": "system", "content": system}, *turns]
    return turns


@dataclasses.dataclass(frozen=True)
class Trained:
    """What sampling reads: the model within its context and its params, the dtype it runs
    in, and how text becomes tokens: ``tokenizer`` (a run on records, or a model directory's
    own), else the run's text ``data`` section (its ``tokenizer.json``, or bytes)."""

    model: TransformerModel
    params: PyTree
    compute: str
    tokenizer: ModelTokenizer | None
    data: Any = None


def _trained(run_dir: Path | str, ema: bool, chat: bool = False, context: int | None = None,
             ) -> Trained:
    """A language-model run's model within ``context`` (``run_model``) and its latest params
    (or their moving average) as that model holds them, or those of a model directory (what
    ``trainrun export`` writes). chat: the run must be one on records, which have a chat
    template."""
    from trainrun.checkpointing.run_context import trained

    if _model_directory(run_dir):
        return _exported(Path(run_dir).expanduser(), ema, context)
    run, config = language_run(run_dir, ema, chat=chat)
    model, _, params = trained(run, config, context, ema=ema)
    tokenizer, data = None, config.data
    if isinstance(data, RecordsData):
        tokenizer = run_records_tokenizer(run, data)
    elif isinstance(data, TextData) and data.tokenizer is not None:  # the copy the run keeps
        data = data.model_copy(update={"tokenizer": run_text_tokenizer(run, data)})
    return Trained(model, params, config.precision.compute, tokenizer, data)


def _model_directory(path: Path | str) -> bool:
    """Whether ``path`` is a local Hugging Face model or PEFT adapter directory (an export)
    rather than a run directory."""
    from trainrun import rundir
    from trainrun.models.huggingface import CONFIG
    from trainrun.models.peft import ADAPTER_CONFIG

    folder = location.location(path)
    if folder.local_path is None:
        return False
    return not (folder / rundir.CONFIG).is_file() and any(
        (folder / name).is_file() for name in (CONFIG, ADAPTER_CONFIG))


def _exported(path: Path, ema: bool, context: int | None) -> Trained:
    """A model directory's model (``trainrun.load``'s) and its own tokenizer (an adapter
    directory's, else its base model's), which sampling reads text through."""
    from trainrun.checkpointing.init_from import records_tokenizer, source_kind
    from trainrun.data import model_tokenizer
    from trainrun.evaluation.language_model import load

    loaded = load(path, ema=ema, context=context)
    where = location.location(path)
    tokenizer, _ = records_tokenizer(where, source_kind(where))
    if not (Path(tokenizer) / "tokenizer.json").is_file():
        raise SampleError(f"{tokenizer} holds no tokenizer.json, which sampling reads text "
                          "through; copy the tokenizer files of the model it came from there")
    return Trained(loaded.config, loaded.params, loaded.compute, model_tokenizer.load(tokenizer))


def language_run(run_dir: Path | str, ema: bool, *, chat: bool = False,
                 doing: str = "sampling", command: str = "sample",
                 ) -> tuple[location.Location, Any]:
    """A run's location and config, refused in one line unless it trains a language model
    (on records, with ``chat``) that keeps a moving average where ``ema`` asks for one.
    doing, command: what the refusals say needs it (``sampling``) and to run without --ema."""
    run = location.location(run_dir)
    config = saved_config(run)
    if config.model.kind != "transformer" or config.data.kind not in ("text", "records"):
        raise SampleError(f"run {run} trains model.kind={config.model.kind} on data.kind="
                          f"{config.data.kind}; {doing} needs a language model "
                          "(model.kind=transformer, data.kind=text or records), e.g. --config lm")
    if chat and not isinstance(config.data, RecordsData):
        raise SampleError(f"run {run} was trained on data.kind={config.data.kind}, which has "
                          "no chat template; --chat needs a run on chat records "
                          "(data.kind=records), e.g. --config chat")
    if ema and config.optimizer.ema is None:
        raise SampleError(f"run {run} keeps no moving average (optimizer.ema is not set); "
                          f"{command} without --ema")
    return run, config


def _sample_records(model: TransformerModel, params: PyTree, found: ModelTokenizer,
                    prompt: str, tokens: int, *, temperature: float, seed: int,
                    compute: str, head: HeadLayout) -> str:
    """The prompt continued by a run on records, through its tokenizer (``found``)."""
    lib = found.tokenizer
    ids = lib.encode(prompt, add_special_tokens=True).ids
    out = generate(model, params, np.array(ids, np.int32), tokens, temperature=temperature,
                   seed=seed, compute=compute, head=head)
    return lib.decode(out.tolist())
