"""trainrun's models in EleutherAI's lm-evaluation-harness: the model class ``trainrun``.

It scores whatever ``trainrun.load(path)`` reads (a run directory, a Hugging Face model
directory as ``trainrun export`` writes it, or a PEFT adapter directory), through the text's
tokenizer (``trainrun.load_tokenizer``). From the shell, lm-eval's own options and output::

    trainrun lm-eval --model trainrun --model_args path=runs/lm_bpe --tasks lambada_openai \\
        --batch_size auto

From Python, importing this module registers the class with lm-eval::

    import lm_eval
    import trainrun.evaluation.harness  # noqa: F401

    lm_eval.simple_evaluate(model="trainrun", model_args={"path": "runs/lm_bpe"},
                            tasks=["lambada_openai"], batch_size="auto")

``--model_args``: ``path`` (required); ``ema`` (a run's moving average of the params);
``max_length`` (the longest window read, default the model's context); ``max_gen_toks`` (the
most tokens ``generate_until`` draws when a task does not say, default 256, as lm-eval's
``hf``); ``chat_template`` (a built-in name, ``chatml`` or ``llama3``, or Jinja text, in place of
the tokenizer's, for ``--apply_chat_template``); ``seed`` (for tasks that sample). Give the batch
size with ``--batch_size``: a number of requests per forward pass, or ``auto`` (as many as keep
the float32 logits of a call near ``AUTO_LOGITS`` values, at most ``--max_batch_size``, 64 by
default). ``--device`` is not read: the model runs on JAX's first device.

Text is tokenized as lm-eval's ``hf`` model tokenizes it (``TemplateLM``: a context's trailing
spaces go to the continuation, an empty context is the tokenizer's begin-of-text id, a text that
already starts with it gets no second), and windows are cut as ``hf`` cuts them, so the two give
the same scores for one model. The requests of a call are packed, longest first, into rows of
one power-of-two width, each attending only to its own tokens at its own positions, so a call
compiles one program (``ScorePrograms``) and no request is padded to a longer one's length;
each batch is one jitted call that returns, per position, the target's log-probability
(log-softmax in float32) and whether it is the most likely token, not the logits.
``generate_until`` decodes through ``LanguageModel.generate_batch``, stopping at the
tokenizer's stop ids and at any token whose text holds one of the task's stop strings; the stop
strings are then cut from the decoded text as ``hf`` cuts them.

Without lm-eval installed (the ``eval`` extra) this module imports, registers nothing and
refuses to build the class in one line.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from trainrun import extras
from trainrun.config import TransformerModel
from trainrun.data.documents import PACKING_BINS, first_fit
from trainrun.errors import UserError
from trainrun.evaluation.language_model import LanguageModel, load
from trainrun.evaluation.text_tokens import TextTokenizer, load_tokenizer
from trainrun.fast import strategies
from trainrun.models.losses import first_max_index
from trainrun.models.transformer import PLAIN_ATTENTION, AttentionPath, bind_transformer
from trainrun.platform.process import command_owns_process
from trainrun.program.precision import DTYPES, cast_floats

NAME = "trainrun"  # the name lm-eval's --model takes
FEATURE = "trainrun's lm-eval model"
AUTO_LOGITS = 2**27  # float32 logits one auto-sized call may hold
AUTO_ROWS = 64  # the most rows of an auto-sized batch without --max_batch_size
MIN_LENGTH = 16  # the narrowest rows: short requests share one program
OPTIONS = ("path", "ema", "max_length", "max_gen_toks", "chat_template", "seed")
TASKS_NOT_FOUND = "Tasks not found: "  # how lm-eval's ValueError names unknown --tasks
# generation settings that change nothing when decoding greedily
GREEDY_IGNORES = ("top_p", "top_k", "min_p", "typical_p")


class HarnessError(UserError):
    """A request or option the model cannot take; one line, exit 2 at the CLI."""


def _template_lm() -> Any:
    """lm-eval's base class, or ``object`` where lm-eval is not installed (the class is then
    refused when built)."""
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError:
        return object
    return TemplateLM


_Base: Any = _template_lm()


class TrainrunLM(_Base):
    """lm-eval's model ``trainrun``: a model ``trainrun.load`` reads, scored and decoded with
    JAX. Built by lm-eval from ``--model_args`` (see the module's docstring)."""

    def __init__(self, path: str | None = None, ema: bool = False, max_length: int | None = None,
                 max_gen_toks: int = 256, chat_template: str | None = None, seed: int = 0,
                 batch_size: int | str | None = None, max_batch_size: int | None = None,
                 device: str | None = None, trust_remote_code: bool | None = None,
                 **unknown: Any) -> None:
        extras.require("eval", FEATURE)
        if command_owns_process():
            # lm-eval's task index, built before the model and alive to the end, is hundreds
            # of thousands of objects that every full collection, and the interpreter's exit,
            # would walk again (BENCHMARKS.md, "lm-evaluation-harness").
            gc.freeze()
        super().__init__()
        if unknown:
            names = ", ".join(sorted(unknown))
            raise HarnessError(f"--model_args {names}: not an option of --model {NAME}; give "
                               f"path=RUN_OR_MODEL_DIR and any of {', '.join(OPTIONS[1:])}")
        if path is None or str(path) == "":
            raise HarnessError(f"--model {NAME} needs the model: give --model_args "
                               "path=RUN_OR_MODEL_DIR (a run, or a Hugging Face or adapter "
                               "directory)")
        self.path = str(path)
        self.seed = _whole("seed", seed, 0)
        self._max_gen_toks = _whole("max_gen_toks", max_gen_toks, 1)
        self._rows, self._max_rows = _batch_size(batch_size, max_batch_size)
        context = None if max_length is None else _whole("max_length", max_length, 2)
        self.model: LanguageModel = load(self.path, ema=_flag("ema", ema), context=context)
        seq_len = self.model.config.seq_len
        if context is not None and context > seq_len:
            raise HarnessError(f"max_length={context}: the run at {self.path} reads at most "
                               f"model.seq_len={seq_len} positions; give at most {seq_len}")
        self._max_length = context or seq_len
        self.text: TextTokenizer = load_tokenizer(
            self.path, chat_template=None if chat_template is None else str(chat_template))
        if self.text.size > self.model.config.vocab:
            raise HarnessError(f"the tokenizer of {self.path} has {self.text.size} tokens, more "
                               f"than the model's vocabulary of {self.model.config.vocab}; give "
                               "the directory of the model it was trained with")
        # Frozen sections hash at run time; pyright reads frozen only from class keywords.
        chosen = strategies.chosen()
        self._programs = ScorePrograms(
            _scorer(self.model.config, self.model.compute,  # pyright: ignore[reportArgumentType]
                    chosen.score_attention()),
            self.model.params, chosen.score_compiler_options())
        self._eos = (None if self.text.eos_id is None
                     else self.text.decode([self.text.eos_id], special=True))
        self._prefix = self.text.decode([self.text.prefix_id], special=True)
        self._stops: dict[tuple[str, ...], tuple[int, ...]] = {}  # by a task's stop strings

    # ---- what lm-eval reads of a model ----------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.text.eos_id if self.text.eos_id is not None else self.text.prefix_id

    @property
    def prefix_token_id(self) -> int:
        return self.text.prefix_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.text.name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """As ``hf``: the tokenizer's own special tokens unless the text starts with the
        begin-of-text token's text already."""
        special = True if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self._prefix and string.startswith(self._prefix):
            special = False
        ids = self.text.encode(string, special=special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.text.decode(tokens, special=not skip_special_tokens)

    def get_model_info(self) -> dict[str, Any]:
        params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(self.model.params))
        return {"model_num_parameters": params, "model_dtype": self.model.compute,
                "model_step": self.model.step}

    # ---- chat templates ---------------------------------------------------------------------

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str):
            raise HarnessError(f"--apply_chat_template {chat_template}: --model {NAME} takes its "
                               f"template from --model_args chat_template={chat_template}; give "
                               "it there and --apply_chat_template alone")
        return self._template().source

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The turns rendered as transformers renders them for ``hf``: with the assistant's
        opening, or (``add_generation_prompt`` False) ending in the last turn's text, to be
        continued; a template that refuses a system turn is tried again without it."""
        from trainrun.data.errors import DataError

        template = self._template()
        try:
            text = template.render(list(chat_history), special=self.text.special,
                                   add_generation_prompt=add_generation_prompt)
        except DataError:
            chat_history = [turn for turn in chat_history if turn.get("role") != "system"]
            text = template.render(chat_history, special=self.text.special,
                                   add_generation_prompt=add_generation_prompt)
        return text if add_generation_prompt else _ending_in(text, chat_history[-1]["content"])

    def _template(self) -> Any:
        if self.text.template is None:
            raise HarnessError(f"the tokenizer of {self.path} has no chat template: give "
                               f"--model_args chat_template=chatml (or llama3, or Jinja text), "
                               "or leave out --apply_chat_template")
        return self.text.template

    # ---- scoring ------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context, the two cut to
        the last ``max_length + 1`` tokens as ``hf`` cuts them. The requests are packed into
        rows of one width (``_packed``), so a request list runs in one program."""
        from tqdm import tqdm

        windows = [(context + continuation)[-(self.max_length + 1):]
                   for _, context, continuation in requests]
        counts = [len(continuation) for _, _, continuation in requests]
        if any(n < 1 or n > self.max_length for n in counts):
            raise HarnessError(f"a continuation of {max(counts)} tokens is longer than "
                               f"max_length={self.max_length}, or empty; raise max_length or "
                               "check the task's targets")
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running loglikelihood requests")
        rows, shape = self._packed([len(window) - 1 for window in windows])
        for first in range(0, len(rows), shape[0]):
            batch = rows[first:first + shape[0]]
            tokens, targets, segments, positions = (np.zeros(shape, np.int32) for _ in range(4))
            ends: list[tuple[int, int, int]] = []  # (request, row, where its inputs end)
            for row, members in enumerate(batch):
                at = 0
                for segment, i in enumerate(members, 1):
                    end = at + len(windows[i]) - 1
                    tokens[row, at:end] = windows[i][:-1]
                    targets[row, at:end] = windows[i][1:]
                    segments[row, at:end] = segment
                    positions[row, at:end] = np.arange(end - at)
                    ends.append((i, row, end))
                    at = end
            score = self._programs.get(shape)
            # host arrays straight into the call: no program compiled to place each shape
            logp, greedy = (np.asarray(a) for a in score(self.model.params, tokens, targets,
                                                         segments, positions))
            for i, row, end in ends:
                scored = slice(end - counts[i], end)
                answer = (float(logp[row, scored].sum(dtype=np.float64)),
                          bool(greedy[row, scored].all()))
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            bar.update(len(ends))
        bar.close()
        return [r if r is not None else (0.0, False) for r in results]  # every one is set

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Each text's log-probability, in the disjoint windows ``hf`` reads it in: every
        token predicted once, after as much of the text before it as ``max_length`` holds."""
        from lm_eval import utils

        windows: list[tuple[None, list[int], list[int]]] = []
        owners: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(utils.make_disjoint_window,
                                             utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logp, _) in zip(owners, scores, strict=True):
            totals[index] += logp
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, decoded greedily (or sampled where a task asks) up to
        the task's ``max_gen_toks``, cut at the first of its stop strings as ``hf`` cuts it."""
        from lm_eval.models.utils import (
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )
        from tqdm import tqdm

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # requests that share their settings decode together
        for index, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(index)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="Running generate_until requests")
        for indices in groups.values():
            settings = dict(normalize_gen_kwargs(requests[indices[0]].args[1],
                                                 self.max_gen_toks))
            until = handle_stop_sequences(
                cast("str | list[str] | None", settings.pop("until", None)), eos=self._eos)
            tokens = int(cast(int, settings.pop("max_gen_toks")))
            temperature = _temperature(settings)
            room = self.max_length - tokens
            if room < 1:
                raise HarnessError(f"max_gen_toks={tokens} leaves no room for a prompt within "
                                   f"max_length={self.max_length}; lower max_gen_toks or raise "
                                   "max_length")
            prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in indices]
            order = sorted(range(len(indices)), key=lambda k: -len(prompts[k]))
            stops = self._stop_ids(tuple(until))
            rows = self._rows or self._max_rows
            # every prompt of a group in one call: one program decodes all its batches
            drawn = self.model.generate_batch([prompts[k] for k in order], tokens,
                                              temperature=temperature, seed=self.seed,
                                              stop_ids=stops, batch_size=rows)
            for k, ids in zip(order, drawn, strict=True):
                request = requests[indices[k]]
                text = postprocess_generated_text(self.tok_decode(ids.tolist()), until, None)
                results[indices[k]] = text
                self.cache_hook.add_partial("generate_until", request.args, text)
            bar.update(len(order))
        bar.close()
        return [r if r is not None else "" for r in results]  # every one is set

    def _stop_ids(self, until: tuple[str, ...]) -> tuple[int, ...]:
        """The tokenizer's stop ids, and every token whose text holds a stop string: decoding
        can end there, since what follows is cut from the text anyway."""
        if until not in self._stops:
            stops = set(self.text.stop_ids)
            words = [word for word in until if word]
            if words:
                for token in range(self.text.size):
                    text = self.text.decode([token], special=True)
                    if any(word in text for word in words):
                        stops.add(token)
            self._stops[until] = tuple(sorted(stops))
        return self._stops[until]

    # ---- batch shapes --------------------------------------------------------------------------

    def _packed(self, inputs: Sequence[int]) -> tuple[list[list[int]], tuple[int, int]]:
        """The rows a request list is scored in (each the indices of the requests it holds,
        the longest first) and the batch shape ``(rows, width)`` every batch of it takes.
        ``inputs``: each request's input tokens. The width is the longest input's padded
        length (``_padded``); shorter requests share rows, first fit, each attending only to
        its own tokens (``Transformer.features``' segments), so no request is padded to a
        longer one's length and the list compiles one program."""
        order = sorted(range(len(inputs)), key=lambda i: -inputs[i])
        width = self._padded(inputs[order[0]]) if order else MIN_LENGTH
        rows = [[order[k] for k in row]
                for row in first_fit([inputs[i] for i in order], width, PACKING_BINS)]
        return rows, (self._batch_rows(width, len(rows)), width)

    def _padded(self, length: int) -> int:
        """The width of rows whose longest input is ``length`` tokens: a power of two, at
        most ``max_length``."""
        return min(max(MIN_LENGTH, 1 << max(0, length - 1).bit_length()), self.max_length)

    def _batch_rows(self, width: int, rows: int) -> int:
        """Rows per batch of ``width`` for a list of ``rows`` packed rows: the batch size (or
        as many as ``auto`` fits), or for a list of fewer the power of two at or above them."""
        if self._rows is not None:
            full = self._rows
        else:
            fits = max(1, AUTO_LOGITS // (width * self.model.config.vocab))
            full = min(1 << (fits.bit_length() - 1), self._max_rows)
        return min(full, 1 << max(0, rows - 1).bit_length())


class ScorePrograms:
    """The score program of each batch shape ``(rows, width)``, compiled once with XLA's
    options for scoring (``fast/strategies.py``)."""

    def __init__(self, score: Any, params: Any, options: dict[str, Any]):
        self.score = score
        self.params = params
        self.options = options
        self.compiled: dict[tuple[int, int], Any] = {}

    def get(self, shape: tuple[int, int]) -> Any:
        """The compiled program of ``shape``."""
        if shape not in self.compiled:
            batch = jax.ShapeDtypeStruct(shape, jnp.int32)
            self.compiled[shape] = self.score.lower(self.params, batch, batch, batch,
                                                    batch).compile(compiler_options=self.options)
        return self.compiled[shape]


def _ending_in(text: str, last: str) -> str:
    """``text`` cut after the last turn's content, as transformers' continue_final_message."""
    found = text.rfind(last.strip())
    if not last.strip() or found < 0:
        raise HarnessError("the chat template does not show the last turn's text; a turn to "
                           "continue needs a template that renders its content as given")
    whole = found + len(last.lstrip())
    return text[:whole] if text[found:whole] == last.lstrip() else text[:found +
                                                                         len(last.strip())]


def _temperature(settings: dict[str, Any]) -> float:
    """The temperature a task's settings (normalized by lm-eval) decode at; a setting the
    decoder has not is refused."""
    sampling = bool(settings.pop("do_sample", False))
    temperature = float(settings.pop("temperature", 0.0))
    temperature = temperature if sampling else 0.0
    ignored = set(GREEDY_IGNORES) if not sampling else set()
    unknown = sorted(set(settings) - ignored)
    if unknown:
        raise HarnessError(f"generation settings {', '.join(unknown)}: --model {NAME} decodes "
                           "with temperature, max_gen_toks and until alone; drop the others "
                           "from the task's generation_kwargs or --gen_kwargs")
    return temperature


def _whole(name: str, value: Any, least: int) -> int:
    """An option's whole number (lm-eval passes numbers, or text where it read no number)."""
    text = str(value).strip()
    if isinstance(value, bool) or not text.lstrip("-").isdigit() or int(text) < least:
        raise HarnessError(f"--model_args {name}={value}: give a whole number >= {least}")
    return int(text)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise HarnessError(f"--model_args {name}={value}: give true or false")


def _batch_size(size: int | str | None, most: int | None) -> tuple[int | None, int]:
    """(requests per batch, None for auto; the most rows an auto-sized batch takes)."""
    rows = AUTO_ROWS if most is None else _whole("max_batch_size", most, 1)
    if size is None or str(size).startswith("auto"):
        return None, rows
    try:
        fixed = int(size)
    except ValueError:
        fixed = 0
    if fixed < 1:
        raise HarnessError(f"--batch_size {size}: give a number of requests >= 1, or auto")
    return fixed, rows


@functools.lru_cache(maxsize=8)
def _scorer(cfg: TransformerModel, compute: str, attention: AttentionPath = PLAIN_ATTENTION
            ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The jitted ``(params, tokens, targets, segments, positions) -> (log p(target), target
    is the argmax)``, each ``[rows, width]``: rows of requests packed as ``segments`` (1, 2, ...
    in a row, 0 padding) with ``positions`` counting from 0 in each, on the model's forward
    (its attention computed as ``attention`` says). Only those two leave the
    device, not the logits."""
    module_of = bind_transformer(cfg, attention)
    dtype = DTYPES[compute]

    def score(params: Any, tokens: jax.Array, targets: jax.Array, segments: jax.Array,
              positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        module = module_of(cast_floats(params, dtype))
        features, _ = module.features(tokens, segments=segments, segment_positions=positions)
        logits = module.head_logits(features)
        flat = targets.reshape(-1)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), flat[:, None],
                                     axis=-1)[:, 0]
        return picked.reshape(tokens.shape), (first_max_index(logits) == flat).reshape(
            tokens.shape)

    return jax.jit(score)


def main(argv: Sequence[str]) -> int:
    """lm-eval's own command line with ``argv`` (``trainrun lm-eval ARGS``), the ``trainrun``
    model registered; 0 when it returns (its errors are its own, but for a ``--tasks`` name
    it does not know: ``HarnessError`` naming them and how to list tasks). In the ``trainrun``
    program's own process (``command_owns_process``) the objects alive when lm-eval builds the
    model are frozen for the garbage collector (``gc.freeze``): they live to the process's end,
    and its collections, the last ones at exit included, skip them."""
    extras.require("eval", "trainrun lm-eval")
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv itself
    try:
        cli_evaluate()
    except ValueError as err:
        missing = str(err).removeprefix(TASKS_NOT_FOUND)
        if missing == str(err):
            raise
        raise HarnessError(f"--tasks {missing}: lm-eval has no such task; "
                           "`trainrun lm-eval ls tasks` lists them (with --include_path DIR, "
                           "your own as well)") from None
    finally:
        sys.argv = saved
    return 0


def _register() -> None:
    if extras.installed("eval"):
        # lm-eval's own models first: its registry fills itself only while it is empty
        import lm_eval.models  # noqa: F401
        from lm_eval.api.registry import register_model

        register_model(NAME)(TrainrunLM)


_register()

__all__ = ["TrainrunLM", "main"]
