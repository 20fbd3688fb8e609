"""Generation from a transformer's params: a batch of prompts (token ids of any lengths)
continued by one jitted program, and the chat and completion answers of runs on records.

A batch is left-padded to its longest prompt; each row's first slot sets its positions and
hides its padding from attention. The prompts fill a key/value cache (``prefill``), then a
``lax.while_loop`` draws one token per row per iteration, attending over the cache, until the
count is drawn or every row has drawn a stop id (a chat turn's end), so nothing is recompiled
per token. Prompt and answer together stay within the model's context (``model.seq_len`` of
the config given: ``trainrun.load`` sets it to what the architecture reads): a longer prompt
keeps its last tokens, an answer stops where the context ends, and a ``ContextWarning`` says
so; attention always covers the whole text.

A token is drawn from the logits divided by the temperature, within the nucleus when ``top_p``
is below 1 (the fewest most likely tokens whose probabilities sum to ``top_p``), from the
batch's key or from each row's own key (``keys``: a row's answer is then the same whatever
rows are beside it). Stop strings (``StopStrings``) are found in the decoded text after the
loop, as TRL and vLLM find them: the answer ends with the token that completes the first.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import TransformerModel
from trainrun.errors import LineWarning, UserError
from trainrun.models.losses import first_max_index
from trainrun.models.transformer import Transformer, bind_transformer
from trainrun.program.precision import DTYPES, cast_floats

if TYPE_CHECKING:  # the tokenizers stack is imported only where text is generated
    from trainrun.data.model_tokenizer import ModelTokenizer

PyTree = Any
Conversation = Sequence[dict[str, str]]  # chat turns: {"role": ..., "content": ...}
# The output head's table as [d_model, vocab], made once per call; None: the model's own.
HeadLayout = Callable[[Transformer], jax.Array | None]


def head_as_trained(module: Transformer) -> None:
    """The head multiplied as training multiplies it (``Transformer.head_table``)."""
    return None


class SampleError(UserError):
    """Generation that cannot run as asked; the CLI prints it on one line and exits 2."""


class ContextWarning(LineWarning):
    """Generation that reached the model's context: a prompt cut to fit it, or an answer
    stopped where it ends. The CLI prints it on one line."""


@dataclasses.dataclass(frozen=True)
class StopStrings:
    """Texts that end an answer where they appear in its decoded text (TRL's and vLLM's
    ``stop``): the answer keeps its tokens up to and including the one whose text completes
    the first stop string to end, and its text is cut before that string.

    strings: the stop strings, none empty.
    detokenize: token ids -> text (the run's tokenizer's ``decode``).
    """

    strings: tuple[str, ...]
    detokenize: Callable[[list[int]], str]

    def __post_init__(self) -> None:
        if any(not text for text in self.strings):
            raise SampleError("a stop string is empty; give each at least one character")

    def first_end(self, text: str) -> tuple[int, int] | None:
        """Where the stop string that ends first in ``text`` starts and ends; None: none is
        in it."""
        found = [(at + len(stop), at) for stop in self.strings if (at := text.find(stop)) >= 0]
        return (min(found)[1], min(found)[0]) if found else None

    def cut(self, text: str) -> str:
        """``text`` up to the stop string that ends first in it (all of it when none is)."""
        span = self.first_end(text)
        return text if span is None else text[:span[0]]

    def tokens_kept(self, ids: np.ndarray) -> int:
        """How many of ``ids`` the answer keeps: up to and including the token that completes
        a stop string (all of them when their text holds none)."""
        held = lambda count: self.first_end(self.detokenize(ids[:count].tolist())) is not None
        if not held(ids.size):
            return int(ids.size)
        low, high = 1, int(ids.size)  # a prefix's text grows with it: the first that holds one
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if held(middle) else (middle + 1, high)
        return low


def generate(cfg: TransformerModel, params: PyTree, prompt: np.ndarray, tokens: int, *,
             temperature: float = 1.0, seed: int = 0, compute: str = "float32",
             stop_ids: Sequence[int] = (), head: HeadLayout = head_as_trained,
             top_p: float = 1.0) -> np.ndarray:
    """``prompt`` (1-D token ids) followed by ``tokens`` sampled ones, or fewer: up to and
    including the first of ``stop_ids`` drawn, or up to the end of the model's context
    (``cfg.seq_len``, prompt included; a ``ContextWarning`` says so).

    temperature: logits are divided by it before sampling; 0 takes the most likely token.
    top_p: sampling draws from the nucleus, the fewest most likely tokens whose probabilities
        sum to ``top_p`` or more (1: every token).
    compute: the dtype the model runs in (the run's ``precision.compute``): params and the
        key/value cache are cast to it; logits are float32.
    head: the output head's layout (``HeadLayout``); another than the default gives the same
        tokens (``fast/head_layout.py``).
    """
    prompt = np.asarray(prompt)
    answer, = generate_batch(cfg, params, [prompt], tokens, temperature=temperature, seed=seed,
                             compute=compute, stop_ids=stop_ids, head=head, top_p=top_p)
    return np.concatenate([prompt.astype(answer.dtype), answer])


BATCH = 16  # prompts decoded together by default


def generate_batch(cfg: TransformerModel, params: PyTree, prompts: Sequence[np.ndarray],
                   tokens: int, *, temperature: float = 1.0, seed: int = 0,
                   compute: str = "float32", stop_ids: Sequence[int] = (),
                   batch_size: int = BATCH, head: HeadLayout = head_as_trained,
                   top_p: float = 1.0, keys: Sequence[jax.Array] | None = None,
                   stop_strings: StopStrings | None = None) -> list[np.ndarray]:
    """What follows each of ``prompts`` (1-D token ids, of any lengths): ``tokens`` ids, or
    fewer: up to and including the first of ``stop_ids`` drawn. ``batch_size`` prompts are
    decoded together, left-padded to the longest, by one program for every batch.

    A greedy answer (temperature 0) is the prompt's own, whatever prompts are beside it;
    sampling draws each batch from ``seed``. Prompt and answer stay within the model's
    context (``cfg.seq_len``): a prompt longer than it keeps its last ``seq_len - 1`` tokens,
    and a prompt whose answer would run past it is decoded among prompts of its own length (a
    program for each such length), its answer stopped where the context ends; one
    ``ContextWarning`` says how many were cut or stopped. head, top_p: as ``generate``'s.

    keys: one key per prompt (``jax.random.key``), ``seed`` then unused: each answer is drawn
        from its prompt's key alone (token ``i`` from ``fold_in(key, i)``), whatever prompts
        are beside it.
    stop_strings: an answer ends with the token that completes one of them (``StopStrings``).
    """
    if not prompts:
        return []
    _require_batch(cfg, prompts, batch_size, keys)
    require_settings(tokens, temperature, seed, top_p)
    # Each prompt's tail that fits the context with room for one generated token.
    contexts = [np.asarray(p[-(cfg.seq_len - 1):], np.int32) for p in prompts]
    groups: dict[int, list[int]] = {}  # 0: answers within the context; else a prompt length
    for i, context in enumerate(contexts):
        groups.setdefault(0 if context.size + tokens <= cfg.seq_len else context.size,
                          []).append(i)
    out: dict[int, np.ndarray] = {}
    stopped = 0  # answers the end of the context stopped before ``tokens``
    key = jax.random.key(seed) if keys is None else jnp.stack(list(keys))
    for length, members in sorted(groups.items()):
        room = tokens if length == 0 else cfg.seq_len - length
        # own keys: the group's rows' keys; else the group's part of the seed's draw
        drawn = (key[np.asarray(members)] if keys is not None else
                 _drawn_from(key, length, temperature))
        answers = _decode_group(cfg, params, [contexts[i] for i in members], room,
                                Sampling(temperature, top_p, drawn), compute, stop_ids,
                                batch_size, head)
        if stop_strings is not None:
            answers = [answer[:stop_strings.tokens_kept(answer)] for answer in answers]
        out.update(zip(members, answers, strict=True))
        if length:
            stopped += sum(a.size == room and int(a[-1]) not in stop_ids for a in answers)
    cut = sum(np.asarray(p).size > c.size for p, c in zip(prompts, contexts, strict=True))
    if cut or stopped:
        warnings.warn(ContextWarning(_reached(len(prompts), cut, stopped, tokens, cfg.seq_len)),
                      stacklevel=2)
    return [out[i] for i in range(len(contexts))]


def _require_batch(cfg: TransformerModel, prompts: Sequence[np.ndarray], batch_size: int,
                   keys: Sequence[jax.Array] | None) -> None:
    """A batch ``generate_batch`` cannot decode, refused in one line."""
    if any(np.asarray(p).size == 0 for p in prompts):
        raise SampleError("the prompt is empty; give at least one character (e.g. --prompt "
                          "'\\n')")
    if keys is not None and len(keys) != len(prompts):
        raise SampleError(f"{len(keys)} keys for {len(prompts)} prompts: give one key per prompt")
    if cfg.seq_len < 2:
        raise SampleError(f"model.seq_len={cfg.seq_len} leaves no room to generate")
    if batch_size < 1:
        raise SampleError(f"batch_size={batch_size}: give at least 1")


def _reached(prompts: int, cut: int, stopped: int, tokens: int, context: int) -> str:
    """The line that says how many of ``prompts`` were ``cut`` to the ``context`` and how
    many answers it ``stopped`` before ``tokens``."""
    said = []
    if cut:
        said.append(f"the prompt was cut to its last {context - 1} tokens" if prompts == 1 else
                    f"{cut} of {prompts} prompts were cut to their last {context - 1} tokens")
    if stopped:
        said.append(f"the answer stopped before {tokens} tokens" if prompts == 1 else
                    f"{stopped} of {prompts} answers stopped before {tokens} tokens")
    return (f"{' and '.join(said)}: the model reads {context} positions, prompt and answer "
            "together (a longer context: trainrun.load(..., context=N) or --context N, as far "
            "as the model's positions allow)")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a group's tokens are drawn: ``temperature``, ``top_p`` (``generate``'s) and ``key``,
    one key for the group's draw or ``[rows]`` keys, each row's own."""

    temperature: float
    top_p: float
    key: jax.Array

    @property
    def own_keys(self) -> bool:
        return self.key.shape != ()

    def of_batch(self, first: int, rows: int) -> jax.Array:
        """The key of the batch of ``rows`` rows from row ``first``: its part of the draw, or
        its rows' keys (the last repeated to fill the batch)."""
        if not self.own_keys:
            return _drawn_from(self.key, first, self.temperature)
        taken = np.minimum(np.arange(first, first + rows), self.key.shape[0] - 1)
        return self.key[taken]

    def decoder(self, cfg: TransformerModel, rows: int, width: int, tokens: int, compute: str,
                padded: bool, head: HeadLayout) -> Callable[..., Any]:
        """The program that draws as this says (``decoder``)."""
        # Frozen sections hash at run time; pyright reads frozen only from class keywords.
        return decoder(cfg, rows, width, tokens, compute, padded, head,  # pyright: ignore[reportArgumentType]
                       self.temperature > 0, nucleus=self.top_p < 1, own_keys=self.own_keys)


def left_padded(contexts: Sequence[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """``contexts`` as the rows the decoder takes: ids ``[rows, width]`` int32, each context at
    its row's end, and each row's first slot ``[rows]`` int32."""
    ids = np.zeros((len(contexts), width), np.int32)
    for row, context in enumerate(contexts):
        ids[row, width - context.size:] = context
    return ids, np.asarray([width - c.size for c in contexts], np.int32)


def stop_array(stop_ids: Sequence[int]) -> np.ndarray:
    """The decoder's ``stops`` operand: ``stop_ids`` and -1 (no id), so it is never empty."""
    return np.asarray([*stop_ids, -1], np.int32)


def _decode_group(cfg: TransformerModel, params: PyTree, contexts: list[np.ndarray],
                  tokens: int, sampling: Sampling, compute: str, stop_ids: Sequence[int],
                  batch_size: int, head: HeadLayout) -> list[np.ndarray]:
    """The answers to ``contexts`` in batches of ``batch_size`` rows, left-padded to the
    longest, by one program (the last batch filled to the same shape)."""
    width = max(c.size for c in contexts)
    rows = min(batch_size, len(contexts))
    padded = any(c.size != width for c in contexts)
    program = sampling.decoder(cfg, rows, width, tokens, compute, padded, head)
    stops = stop_array(stop_ids)
    # the nucleus's bound is an operand of the programs that hold one
    top_p = (np.float32(sampling.top_p),) if sampling.top_p < 1 else ()
    out: list[np.ndarray] = []
    for first in range(0, len(contexts), rows):
        group = contexts[first:first + rows]
        group += [group[-1]] * (rows - len(group))
        ids, start = left_padded(group, width)
        # host arrays straight into the call: no small program compiled to place each one
        drawn, counts = program(params, ids, start, np.float32(sampling.temperature),
                                sampling.of_batch(first, rows), stops, *top_p)
        drawn, counts = np.asarray(drawn), np.asarray(counts)
        out += [drawn[row, :counts[row]] for row in range(min(rows, len(contexts) - first))]
    return out


def _drawn_from(key: jax.Array, index: int, temperature: float) -> jax.Array:
    """The key of part ``index`` of a draw: ``fold_in(key, index)``; greedy decoding draws
    nothing, so its key is passed on as it is, without a program compiled to fold it."""
    return jax.random.fold_in(key, index) if temperature > 0 else key


SEED_MAX = 2**32 - 1  # jax.random.key's range without wrapping, as the config's seed


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical(key, logits)``'s draw, the same bits (the greatest of the logits
    plus Gumbel noise), with its argmax as ``first_max_index``."""
    return first_max_index(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def require_settings(tokens: int, temperature: float, seed: int, top_p: float = 1.0) -> None:
    """Decoding settings refused in one line, before a checkpoint is read."""
    if tokens < 1:
        raise SampleError(f"--tokens {tokens}: give at least 1 token to generate")
    if not temperature >= 0 or temperature == float("inf"):  # NaN fails the first test
        raise SampleError(f"--temperature {temperature}: give a finite temperature >= 0 (0: "
                          "the most likely token each time)")
    if not 0 <= seed <= SEED_MAX:
        raise SampleError(f"--seed {seed}: give a seed from 0 to {SEED_MAX}")
    if not 0 < top_p <= 1:  # NaN fails it too
        raise SampleError(f"top_p={top_p}: give a value above 0 and at most 1 (1: sampling "
                          "from every token)")


def nucleus_logits(logits: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """``logits`` ``[rows, vocab]`` with each row's tokens outside its nucleus at -inf: the
    nucleus is the fewest most likely tokens whose probabilities sum to ``top_p`` or more (a
    token is kept when the tokens more likely than it hold less than ``top_p``; the most likely
    always, and every token as likely as the least likely kept)."""
    probs = jax.nn.softmax(logits, axis=-1)
    ranked = -jnp.sort(-probs, axis=-1)  # most likely first
    before = jnp.cumsum(ranked, axis=-1) - ranked  # the mass of the tokens ranked above
    least = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(probs >= least, logits, -jnp.inf)


@functools.lru_cache(maxsize=8)
def decoder(cfg: TransformerModel, rows: int, width: int, tokens: int,
            compute: str = "float32", padded: bool = False,
            head_layout: HeadLayout = head_as_trained, sampled: bool = True, *,
            nucleus: bool = False, own_keys: bool = False):
    """The jitted decoder of ``rows`` prompts of ``width`` tokens (left-padded when
    ``padded``; each row's ``start`` is its first token) and ``tokens`` tokens, its output head
    laid out by ``head_layout``: one program (``jit(decode)``), compiled once, for every prompt
    of that shape, token, seed and temperature above 0 (``sampled``), or greedily at
    temperature 0, a program that holds no sampler (and compiles in less time);
    ``generate_batch`` runs it.

    It takes ``(params, prompts [rows, width] int32, start [rows] int32, temperature float32,
    key, stops [n] int32)``, and with ``nucleus`` a last operand ``top_p`` float32 (the
    nucleus's bound, ``nucleus_logits``), and returns the drawn ids ``[rows, tokens]`` and each
    row's count of them. Token ``i`` is drawn from ``fold_in(key, i)``; with ``own_keys`` the
    key is ``[rows]`` keys, each row drawing from its own. ``width + tokens`` is within the
    model's context: ``generate_batch`` sees to it."""
    module_of = bind_transformer(cfg)
    dtype = DTYPES[compute]
    # The cache holds what this call needs: a model made for a long context is not given a
    # cache of that length for a short answer.
    window = width + tokens

    def pick(logits: jax.Array, key: jax.Array, temperature: jax.Array,
             top_p: jax.Array | float) -> jax.Array:
        if not sampled:  # greedy draws no noise: no random bits, nor their compile
            return first_max_index(logits)
        scaled = logits / jnp.maximum(temperature, 1e-6)
        if nucleus:
            scaled = nucleus_logits(scaled, top_p)
        if own_keys:
            return jax.vmap(categorical)(key, scaled)
        return categorical(key, scaled)

    def token_key(key: jax.Array, i: jax.Array) -> jax.Array:
        return (jax.vmap(jax.random.fold_in, (0, None))(key, i) if own_keys else
                jax.random.fold_in(key, i))

    def decode(params, prompts, start, temperature, key, stops, top_p=1.0):
        module: Transformer = module_of(cast_floats(params, dtype))
        head = head_layout(module)  # carried into the loop as an operand: made once per call
        seq = jnp.zeros((rows, window), jnp.int32).at[:, :width].set(prompts)
        logits, filled = module.last_logits(prompts, module.empty_cache(rows, window, dtype),
                                            0, start if padded else None, head)

        def body(carry):
            i, done, counts, seq, cache, pos, start, last = carry
            token = pick(last, token_key(key, i), temperature, top_p)
            counts = counts + ~done  # a row counts the tokens it draws, its stop id included
            done = done | jnp.any(token[:, None] == stops[None], axis=-1)
            end = width + i  # the new tokens' slot in seq
            seq = jax.lax.dynamic_update_slice(seq, token[:, None], (0, end))
            logits, cache = module.last_logits(token[:, None], cache, pos,
                                               start if padded else None, head)
            return i + 1, done, counts, seq, cache, pos + 1, start, logits

        carry = (jnp.int32(0), jnp.zeros(rows, bool), jnp.zeros(rows, jnp.int32), seq, filled,
                 jnp.int32(width), start, logits)
        _, _, counts, seq, *_ = jax.lax.while_loop(
            lambda carry: (carry[0] < tokens) & ~jnp.all(carry[1]), body, carry)
        return seq[:, width:width + tokens], counts

    return jax.jit(decode)


def chat_replies(model: TransformerModel, params: PyTree, found: ModelTokenizer,
                 conversations: Sequence[Conversation], tokens: int, *, temperature: float,
                 seed: int, compute: str, batch_size: int = BATCH,
                 head: HeadLayout = head_as_trained) -> list[str]:
    """The answer that follows each conversation's turns (rendered with the chat template of
    ``found``, the run's tokenizer), ended at the turn's end. head: as ``generate``'s."""
    from trainrun.data.examples import require_template

    template = require_template(found)
    prompts = [np.array(found.tokenizer.encode(
        template.render(list(turns), add_generation_prompt=True, special=found.special),
        add_special_tokens=False).ids, np.int32) for turns in conversations]
    answers = generate_batch(model, params, prompts, tokens, temperature=temperature,
                             seed=seed, compute=compute, stop_ids=found.stop_ids,
                             batch_size=batch_size, head=head)
    stops = set(found.stop_ids)
    return [found.tokenizer.decode(answer[:-1].tolist() if answer.size and
                                   int(answer[-1]) in stops else answer.tolist())
            for answer in answers]


def complete(model: TransformerModel, params: PyTree, found: ModelTokenizer,
             prompts: Sequence[str], tokens: int, *, temperature: float, seed: int,
             compute: str, batch_size: int = BATCH,
             head: HeadLayout = head_as_trained) -> list[str]:
    """The completion of each prompt as a run on completion records learned them: the prompt
    encoded as a text's start, the completion up to the end-of-text token (not included).
    head: as ``generate``'s."""
    lib = found.tokenizer
    ids = [np.array(lib.encode(prompt, add_special_tokens=True).ids, np.int32)
           for prompt in prompts]
    stops = [] if found.eos_id is None else [found.eos_id]
    answers = generate_batch(model, params, ids, tokens, temperature=temperature, seed=seed,
                             compute=compute, stop_ids=stops, batch_size=batch_size,
                             head=head)
    return [lib.decode(answer[:-1].tolist() if answer.size and int(answer[-1]) in stops
                       else answer.tolist()) for answer in answers]
