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
    if prompt.size == 0:
        raise SampleError("the prompt is empty; give at least one character (e.g. --prompt "
                          "'\\n')")
    require_settings(tokens, temperature, seed)
    if cfg.seq_len < 2:
        raise SampleError(f"model.seq_len={cfg.seq_len} leaves no room to generate")
    # The prompt's tail that fits the context with room for one generated token.
    context = np.asarray(prompt[-(cfg.seq_len - 1):], np.int32)
    # Frozen sections hash at run time; pyright reads frozen only from class keywords.
    program = _decoder(cfg,  # pyright: ignore[reportArgumentType]
                       int(prompt.size), int(context.size), tokens, compute)
    stops = np.asarray([*stop_ids, -1], np.int32)  # -1: no id, so the array is never empty
    out, drawn = program(params, jnp.asarray(prompt, jnp.int32), jnp.asarray(context),
                         jnp.float32(temperature), jax.random.key(seed), jnp.asarray(stops))
    return np.asarray(out)[:prompt.size + int(drawn)]


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
def _decoder(cfg: TransformerModel, prompt_len: int, context_len: int, tokens: int,
             compute: str = "float32"):
    """The jitted decoder for one prompt length and token count: one program, compiled once,
    for every token, seed and temperature."""
    module_of = bind_transformer(cfg)
    dtype = DTYPES[compute]
    # The cache holds what this call needs, up to the model's context: a model made for a long
    # context is not given a cache of that length for a short answer.
    window = min(cfg.seq_len, prompt_len + tokens)
    keep = window // 2  # tokens carried into a fresh cache when the cache is full

    def pick(logits: jax.Array, key: jax.Array, temperature: jax.Array) -> jax.Array:
        sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)

    def decode(params, prompt, context, temperature, key, stops):
        module: Transformer = module_of(cast_floats(params, dtype))
        # At least ``keep`` long, so the refill's slice is valid even where the text is too
        # short to ever fill the cache (then the refill is traced but never taken).
        length = prompt_len + tokens
        seq = jnp.zeros(max(length, keep), jnp.int32).at[:prompt_len].set(prompt)
        logits, filled = module(context[None], cache=module.empty_cache(1, window, dtype), pos=0)

        def refill(seq: jax.Array, end: jax.Array):
            """A fresh cache holding the ``keep`` tokens before ``end``."""
            recent = jax.lax.dynamic_slice(seq, (end - keep,), (keep,))
            _, fresh = module(recent[None], cache=module.empty_cache(1, window, dtype), pos=0)
            return fresh

        def body(carry):
            i, _, seq, cache, pos, last = carry
            token = pick(last, jax.random.fold_in(key, i), temperature)
            end = prompt_len + i  # the new token's index in seq
            seq = seq.at[end].set(token)
            cache, pos = jax.lax.cond(pos >= window,
                                      lambda: (refill(seq, end), jnp.int32(keep)),
                                      lambda: (cache, pos))
            logits, cache = module(token[None, None], cache=cache, pos=pos)
            return i + 1, jnp.any(token == stops), seq, cache, pos + 1, logits[0, -1]

        carry = (jnp.int32(0), jnp.bool_(False), seq, filled, jnp.int32(context_len),
                 logits[0, -1])
        drawn, _, seq, *_ = jax.lax.while_loop(
            lambda carry: (carry[0] < tokens) & ~carry[1], body, carry)
        return seq[:length], drawn

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
                               tokens, chat=None,
                               temperature=temperature, seed=seed, compute=compute)
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
                 system: str | None = None) -> list[str]:
    """The answers of a run on chat records, the checkpoint read once: to each question (a user
    turn, after ``system`` when given: what ``sample --chat`` prints) or conversation (its turns
    as records hold them, system prompt included; the answer follows the last turn)."""
    require_settings(tokens, temperature, seed)
    conversations = [conversation(q, system) for q in questions]
    config, params = _trained(run_dir, ema, chat=True)
    assert isinstance(config.data, RecordsData)
    found = _run_tokenizer(config.data)  # read once for every conversation
    return [_sample_records(config.model, params, found, "", tokens, chat=turns,
                            temperature=temperature, seed=seed,
                            compute=config.precision.compute) for turns in conversations]


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
                    prompt: str, tokens: int, *, chat: Conversation | None, temperature: float,
                    seed: int, compute: str) -> str:
    """Text from a run on records, through its tokenizer (``found``): the prompt continued, or
    the answer that follows a conversation's turns."""
    from trainrun.data.examples import require_template

    lib = found.tokenizer
    if chat is None:
        ids = lib.encode(prompt, add_special_tokens=True).ids
        out = generate(model, params, np.array(ids, np.int32), tokens, temperature=temperature,
                       seed=seed, compute=compute)
        return lib.decode(out.tolist())
    text = require_template(found).render(list(chat), add_generation_prompt=True,
                                          special=found.special)
    ids = lib.encode(text, add_special_tokens=False).ids
    out = generate(model, params, np.array(ids, np.int32), tokens, temperature=temperature,
                   seed=seed, compute=compute, stop_ids=found.stop_ids)
    answer = out[len(ids):].tolist()
    if answer and answer[-1] in found.stop_ids:
        answer = answer[:-1]
    return lib.decode(answer)
