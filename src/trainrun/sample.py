"""Text from a trained language model: ``trainrun sample RUN_DIR --prompt "def "``, or the
answer to a chat turn: ``trainrun sample RUN_DIR --chat "question"``.

Decoding runs as one jitted program: the prompt fills a key/value cache (``prefill``), then a
``lax.while_loop`` draws one token per iteration, attending over the cache, until the count is
drawn or a stop id (a chat turn's end) is, so nothing is recompiled per token. The cache
holds the model's context (``model.seq_len``); when it is full the last half of the text is
re-read into a fresh cache and decoding goes on from there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.checkpointing.reader import latest_state, saved_config
from trainrun.config import RecordsData, TransformerModel
from trainrun.errors import UserError
from trainrun.models.transformer import Transformer, bind_transformer
from trainrun.program.precision import DTYPES, cast_floats
from trainrun.rundir import location

if TYPE_CHECKING:  # the tokenizers stack is imported only where a run on records is sampled
    from trainrun.data.model_tokenizer import ModelTokenizer

PyTree = Any


class SampleError(UserError):
    """A run that cannot be sampled as asked; the CLI prints it on one line and exits 2."""


def generate(cfg: TransformerModel, params: PyTree, prompt: np.ndarray, tokens: int, *,
             temperature: float = 1.0, seed: int = 0, compute: str = "float32",
             stop_ids: Sequence[int] = ()) -> np.ndarray:
    """``prompt`` (1-D token ids) followed by ``tokens`` sampled ones, or fewer: up to and
    including the first of ``stop_ids`` drawn.

    temperature: logits are divided by it before sampling; 0 takes the most likely token.
    compute: the dtype the model runs in (the run's ``precision.compute``): params and the
        key/value cache are cast to it; logits are float32.
    """
    prompt = np.asarray(prompt)
    answer, = generate_batch(cfg, params, [prompt], tokens, temperature=temperature, seed=seed,
                             compute=compute, stop_ids=stop_ids)
    return np.concatenate([prompt.astype(answer.dtype), answer])


BATCH = 16  # prompts decoded together by default


def generate_batch(cfg: TransformerModel, params: PyTree, prompts: Sequence[np.ndarray],
                   tokens: int, *, temperature: float = 1.0, seed: int = 0,
                   compute: str = "float32", stop_ids: Sequence[int] = (),
                   batch_size: int = BATCH) -> list[np.ndarray]:
    """What follows each of ``prompts`` (1-D token ids, of any lengths): ``tokens`` ids, or
    fewer: up to and including the first of ``stop_ids`` drawn. ``batch_size`` prompts are
    decoded together, left-padded to the longest, by one program for every batch.

    A greedy answer (temperature 0) is the prompt's own, whatever prompts are beside it;
    sampling draws each batch from ``seed``. A prompt whose answer may run past the model's
    context (which is then re-read from its last half) is decoded among prompts of its own
    length, a program for each such length."""
    if not prompts:
        return []
    if any(np.asarray(p).size == 0 for p in prompts):
        raise SampleError("the prompt is empty; give at least one character (e.g. --prompt "
                          "'\\n')")
    require_settings(tokens, temperature, seed)
    if cfg.seq_len < 2:
        raise SampleError(f"model.seq_len={cfg.seq_len} leaves no room to generate")
    if batch_size < 1:
        raise SampleError(f"batch_size={batch_size}: give at least 1")
    # Each prompt's tail that fits the context with room for one generated token.
    contexts = [np.asarray(p[-(cfg.seq_len - 1):], np.int32) for p in prompts]
    groups: dict[int, list[int]] = {}  # 0: answers within the context; else a prompt length
    for i, context in enumerate(contexts):
        groups.setdefault(0 if context.size + tokens <= cfg.seq_len else context.size,
                          []).append(i)
    out: dict[int, np.ndarray] = {}
    key = jax.random.key(seed)
    for length, members in sorted(groups.items()):
        answers = _decode_group(cfg, params, [contexts[i] for i in members], tokens,
                                temperature, jax.random.fold_in(key, length), compute,
                                stop_ids, batch_size)
        out.update(zip(members, answers, strict=True))
    return [out[i] for i in range(len(contexts))]


def _decode_group(cfg: TransformerModel, params: PyTree, contexts: list[np.ndarray],
                  tokens: int, temperature: float, key: jax.Array, compute: str,
                  stop_ids: Sequence[int], batch_size: int) -> list[np.ndarray]:
    """The answers to ``contexts`` in batches of ``batch_size`` rows, left-padded to the
    longest, by one program (the last batch filled to the same shape)."""
    width = max(c.size for c in contexts)
    rows = min(batch_size, len(contexts))
    padded = any(c.size != width for c in contexts)
    program = _decoder(cfg, rows, width, tokens, compute, padded)
    stops = jnp.asarray([*stop_ids, -1], jnp.int32)  # -1: no id, so the array is never empty
    out: list[np.ndarray] = []
    for first in range(0, len(contexts), rows):
        group = contexts[first:first + rows]
        group += [group[-1]] * (rows - len(group))
        ids = np.zeros((rows, width), np.int32)
        for row, context in enumerate(group):
            ids[row, width - context.size:] = context
        start = np.asarray([width - c.size for c in group], np.int32)
        drawn, counts = program(params, jnp.asarray(ids), jnp.asarray(start),
                                jnp.float32(temperature), jax.random.fold_in(key, first), stops)
        drawn, counts = np.asarray(drawn), np.asarray(counts)
        out += [drawn[row, :counts[row]] for row in range(min(rows, len(contexts) - first))]
    return out


SEED_MAX = 2**32 - 1  # jax.random.key's range without wrapping, as the config's seed


def require_settings(tokens: int, temperature: float, seed: int) -> None:
    """Decoding settings refused in one line, before a checkpoint is read."""
    if tokens < 1:
        raise SampleError(f"--tokens {tokens}: give at least 1 token to generate")
    if not temperature >= 0 or temperature == float("inf"):  # NaN fails the first test
        raise SampleError(f"--temperature {temperature}: give a finite temperature >= 0 (0: "
                          "the most likely token each time)")
    if not 0 <= seed <= SEED_MAX:
        raise SampleError(f"--seed {seed}: give a seed from 0 to {SEED_MAX}")


@functools.lru_cache(maxsize=8)
def _decoder(cfg: TransformerModel, rows: int, width: int, tokens: int,
             compute: str = "float32", padded: bool = False):
    """The jitted decoder of ``rows`` prompts of ``width`` tokens (left-padded when
    ``padded``; each row's ``start`` is its first token) and ``tokens`` tokens: one program,
    compiled once, for every prompt of that shape, token, seed and temperature."""
    module_of = bind_transformer(cfg)
    dtype = DTYPES[compute]
    # The cache holds what this call needs, up to the model's context: a model made for a long
    # context is not given a cache of that length for a short answer.
    window = min(cfg.seq_len, width + tokens)
    keep = window // 2  # tokens carried into a fresh cache when the cache is full

    def pick(logits: jax.Array, key: jax.Array, temperature: jax.Array) -> jax.Array:
        sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, jnp.argmax(logits, -1)).astype(jnp.int32)

    def decode(params, prompts, start, temperature, key, stops):
        module: Transformer = module_of(cast_floats(params, dtype))
        # At least ``keep`` long, so the refill's slice is valid even where the text is too
        # short to ever fill the cache (then the refill is traced but never taken).
        seq = jnp.zeros((rows, max(width + tokens, keep)), jnp.int32).at[:, :width].set(prompts)
        logits, filled = module(prompts, cache=module.empty_cache(rows, window, dtype), pos=0,
                                start=start if padded else None)

        def refill(seq: jax.Array, end: jax.Array, start: jax.Array):
            """A fresh cache holding the ``keep`` slots before ``end``, and each row's first
            slot in it."""
            recent = jax.lax.dynamic_slice(seq, (0, end - keep), (rows, keep))
            start = jnp.maximum(start - (end - keep), 0)
            _, fresh = module(recent, cache=module.empty_cache(rows, window, dtype), pos=0,
                              start=start if padded else None)
            return fresh, start

        def body(carry):
            i, done, counts, seq, cache, pos, start, last = carry
            token = pick(last, jax.random.fold_in(key, i), temperature)
            counts = counts + ~done  # a row counts the tokens it draws, its stop id included
            done = done | jnp.any(token[:, None] == stops[None], axis=-1)
            end = width + i  # the new tokens' slot in seq
            seq = jax.lax.dynamic_update_slice(seq, token[:, None], (0, end))
            cache, start, pos = jax.lax.cond(
                pos >= window, lambda: (*refill(seq, end, start), jnp.int32(keep)),
                lambda: (cache, start, pos))
            logits, cache = module(token[:, None], cache=cache, pos=pos,
                                   start=start if padded else None)
            return i + 1, done, counts, seq, cache, pos + 1, start, logits[:, -1]

        carry = (jnp.int32(0), jnp.zeros(rows, bool), jnp.zeros(rows, jnp.int32), seq, filled,
                 jnp.int32(width), start, logits[:, -1])
        _, _, counts, seq, *_ = jax.lax.while_loop(
            lambda carry: (carry[0] < tokens) & ~jnp.all(carry[1]), body, carry)
        return seq[:, width:width + tokens], counts

    return jax.jit(decode)


Conversation = Sequence[dict[str, str]]  # chat turns: {"role": ..., "content": ...}


def sample_run(run_dir: Path | str, prompt: str, tokens: int, *, temperature: float = 0.8,
               seed: int = 0, ema: bool = False, chat: str | None = None,
               system: str | None = None) -> str:
    """The prompt and ``tokens`` bytes sampled from the latest checkpoint of an LM run (with
    ``ema``: from its params' moving average, ``optimizer.ema``). chat: a user turn, rendered
    with the run's chat template after ``system`` (a system prompt) when given; the answer alone
    is returned, ended at the turn's end."""
    require_settings(tokens, temperature, seed)
    if chat is not None:
        return chat_answers(run_dir, [chat], tokens, temperature=temperature, seed=seed,
                            ema=ema, system=system)[0]
    if system is not None:
        raise SampleError("a system prompt (--system) goes with a chat turn: give --chat TEXT "
                          "or --file conversations.jsonl")
    config, params = _trained(run_dir, ema)
    compute = config.precision.compute
    if isinstance(config.data, RecordsData):
        return _sample_records(config.model, params, _run_tokenizer(config.data), prompt,
                               tokens, temperature=temperature, seed=seed, compute=compute)
    if config.data.tokenizer is not None:  # a tokenized run: text in and out through its own
        from trainrun.data.tokenizer import DOCUMENT_TOKEN, load

        tokenizer = load(config.data.tokenizer, config.data.vocab_size)
        # As in training, a document starts with the document token: the prompt opens one.
        ids = [tokenizer.token_to_id(DOCUMENT_TOKEN), *tokenizer.encode(prompt).ids]
        out = generate(config.model, params, np.array(ids, np.int32), tokens,
                       temperature=temperature, seed=seed, compute=compute)
        return tokenizer.decode(out[1:].tolist())
    out = generate(config.model, params, np.frombuffer(prompt.encode(), np.uint8), tokens,
                   temperature=temperature, seed=seed, compute=compute)
    return out.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def chat_answers(run_dir: Path | str, questions: Sequence[str | Conversation], tokens: int, *,
                 temperature: float = 0.8, seed: int = 0, ema: bool = False,
                 system: str | None = None, batch_size: int = BATCH) -> list[str]:
    """The answers of a run on chat records, the checkpoint read once and the conversations
    decoded ``batch_size`` at a time by one program: to each question (a user turn, after
    ``system`` when given: what ``sample --chat`` prints) or conversation (its turns as
    records hold them, system prompt included; the answer follows the last turn)."""
    require_settings(tokens, temperature, seed)
    conversations = [conversation(q, system) for q in questions]
    config, params = _trained(run_dir, ema, chat=True)
    assert isinstance(config.data, RecordsData)
    return chat_replies(config.model, params, _run_tokenizer(config.data), conversations,
                        tokens, temperature=temperature, seed=seed,
                        compute=config.precision.compute, batch_size=batch_size)


def chat_replies(model: TransformerModel, params: PyTree, found: ModelTokenizer,
                 conversations: Sequence[Conversation], tokens: int, *, temperature: float,
                 seed: int, compute: str, batch_size: int = BATCH) -> list[str]:
    """The answer that follows each conversation's turns (rendered with the chat template of
    ``found``, the run's tokenizer), ended at the turn's end."""
    from trainrun.data.examples import require_template

    template = require_template(found)
    prompts = [np.array(found.tokenizer.encode(
        template.render(list(turns), add_generation_prompt=True, special=found.special),
        add_special_tokens=False).ids, np.int32) for turns in conversations]
    answers = generate_batch(model, params, prompts, tokens, temperature=temperature,
                             seed=seed, compute=compute, stop_ids=found.stop_ids,
                             batch_size=batch_size)
    stops = set(found.stop_ids)
    return [found.tokenizer.decode(answer[:-1].tolist() if answer.size and
                                   int(answer[-1]) in stops else answer.tolist())
            for answer in answers]


def complete(model: TransformerModel, params: PyTree, found: ModelTokenizer,
             prompts: Sequence[str], tokens: int, *, temperature: float, seed: int,
             compute: str, batch_size: int = BATCH) -> list[str]:
    """The completion of each prompt as a run on completion records learned them: the prompt
    encoded as a text's start, the completion up to the end-of-text token (not included)."""
    lib = found.tokenizer
    ids = [np.array(lib.encode(prompt, add_special_tokens=True).ids, np.int32)
           for prompt in prompts]
    stops = [] if found.eos_id is None else [found.eos_id]
    answers = generate_batch(model, params, ids, tokens, temperature=temperature, seed=seed,
                             compute=compute, stop_ids=stops, batch_size=batch_size)
    return [lib.decode(answer[:-1].tolist() if answer.size and int(answer[-1]) in stops
                       else answer.tolist()) for answer in answers]


def read_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSONL file, one ``{"messages": [...]}`` object a line (blank
    lines skipped); a line that is not one is refused naming the file and the line."""
    import json

    try:
        text = Path(path).read_text(encoding="utf-8")
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
        turns = [{"role": "user", "content": question}]
        return turns if system is None else [{"role": "system", "content": system}, *turns]
    turns = [dict(turn) if isinstance(turn, dict) else {} for turn in question]
    if not turns or any(set(t) != {"role", "content"} or not all(isinstance(v, str)
                                                                 for v in t.values())
                        for t in turns):
        raise SampleError("a conversation is a list of turns {\"role\": ..., \"content\": ...} "
                          "(text); give at least one")
    if turns[-1]["role"] == "assistant":
        raise SampleError("a conversation ends with the assistant's turn; end it with the turn "
                          "to answer (a user turn)")
    if system is not None:
        if turns[0]["role"] == "system":
            raise SampleError("a conversation has its own system prompt and --system gives "
                              "another; drop one of them")
        turns = [{"role": "system", "content": system}, *turns]
    return turns


def _trained(run_dir: Path | str, ema: bool, chat: bool = False) -> tuple[Any, PyTree]:
    """A language-model run's config and its latest params (or their moving average). chat:
    the run must be one on records, which have a chat template."""
    run_dir = location.location(run_dir)
    config = saved_config(run_dir)
    if config.model.kind != "transformer" or config.data.kind not in ("text", "records"):
        raise SampleError(f"run {run_dir} trains model.kind={config.model.kind} on data.kind="
                          f"{config.data.kind}; sampling needs a language model "
                          "(model.kind=transformer, data.kind=text or records), e.g. --config lm")
    if chat and not isinstance(config.data, RecordsData):
        raise SampleError(f"run {run_dir} was trained on data.kind={config.data.kind}, which has "
                          "no chat template; --chat needs a run on chat records "
                          "(data.kind=records), e.g. --config chat")
    if ema and config.optimizer.ema is None:
        raise SampleError(f"run {run_dir} keeps no moving average (optimizer.ema is not set); "
                          "sample without --ema")
    _, state = latest_state(run_dir, config)
    return config, state.ema if ema else state.params


def _run_tokenizer(data: RecordsData) -> ModelTokenizer:
    """The tokenizer and chat template a run on records was trained with."""
    from trainrun.data import model_tokenizer

    return model_tokenizer.load(data.tokenizer or model_tokenizer.BYTES, data.chat_template)


def _sample_records(model: TransformerModel, params: PyTree, found: ModelTokenizer,
                    prompt: str, tokens: int, *, temperature: float, seed: int,
                    compute: str) -> str:
    """The prompt continued by a run on records, through its tokenizer (``found``)."""
    lib = found.tokenizer
    ids = lib.encode(prompt, add_special_tokens=True).ids
    out = generate(model, params, np.array(ids, np.int32), tokens, temperature=temperature,
                   seed=seed, compute=compute)
    return lib.decode(out.tolist())
