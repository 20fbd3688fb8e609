"""Chat templates: conversations rendered to text the way Hugging Face transformers'
``apply_chat_template`` renders them, and the assistant turns a fine-tune learns from found in
that text and in its tokens.

A template is Jinja run in an immutable sandbox with transformers' settings: ``trim_blocks``,
``lstrip_blocks``, ``{% break %}``/``{% continue %}``, a ``tojson`` filter that keeps non-ASCII
and does not escape HTML, the globals ``raise_exception`` and ``strftime_now``, ``dict`` and
``namespace`` that refuse underscore names, and the block ``{% generation %}...{% endgeneration %}``
that marks assistant text. It sees ``messages``, ``add_generation_prompt``, ``tools`` and
``documents`` (both None) and the special tokens (``bos_token``, ``eos_token``, ...).

What the loss counts (``ChatTemplate.assistant_spans``):

- A template with ``{% generation %}`` blocks: exactly the text each block renders, as
  transformers' ``return_assistant_tokens_mask`` does. The built-in templates put the end-of-turn
  token inside the block and the line break after it outside.
- A template without them: for each assistant message ``i``, the text that message adds after
  the generation prompt, i.e. ``render(messages[:i + 1])`` minus
  ``render(messages[:i], add_generation_prompt=True)``, without its trailing whitespace. That is
  the content and the end-of-turn token after it (the model must learn to stop), but not the
  role header (given at inference as the generation prompt) nor the line break that follows the
  end-of-turn token (never generated: decoding stops at that token). Both renders must be
  prefixes of the whole conversation's render; a template that renders a turn differently once
  later turns follow (one that drops past reasoning, say) cannot be split so and is refused.

A token counts when its characters overlap a span (transformers 5's rule), so a token that
starts just before the span, such as a word with its leading space, counts too.

A template that cannot render any conversation is refused as a whole (``TemplateFailed``), not
record by record: one that recurses without end (a macro that calls itself) or nests too deep
to compile, or whose text holds a lone UTF-16 surrogate (no text: no tokenizer takes it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from trainrun.data.errors import DataError
from trainrun.errors import printable
from trainrun.storage import location
from trainrun.storage.location import Location

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
BUILT_IN = {"chatml": CHATML, "llama3": LLAMA3}
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template here
NO_SPECIAL_TOKENS: Mapping[str, str] = MappingProxyType({})
MIN_JINJA = (3, 1, 6)  # older releases have sandbox escapes; model templates are untrusted
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers fills them all
GENERATION_METHOD = "_mark"  # the extension's method a {% generation %} block calls


@dataclasses.dataclass
class _Recording:
    """Where the ``{% generation %}`` blocks of one render land: ``length`` is how many
    characters the render has produced so far."""

    length: int = 0
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


# Set only while ``assistant_spans`` renders, per thread, so a shared template stays reentrant.
_RECORDING: ContextVar[_Recording | None] = ContextVar("chat_recording", default=None)


class TemplateFailed(DataError):
    """A chat template that cannot render any conversation: the template is at fault, not a
    record, so no record policy skips it."""


class ChatTemplate:
    """A Jinja chat template, rendered the way Hugging Face transformers' apply_chat_template
    renders it.

    source: the template text; compiled at construction (a syntax error is a DataError).
    origin: where the template comes from (a setting or a file), for messages; None: unsaid.
    generation_blocks: whether the template marks assistant text with ``{% generation %}``.
    """

    def __init__(self, source: str, origin: str | None = None) -> None:
        self.source = source
        self.origin = origin
        surrogate = _first_surrogate(source)
        if surrogate is not None:
            line = source.count("\n", 0, surrogate) + 1
            raise TemplateFailed(f"{self.named_as()} holds a lone UTF-16 surrogate "
                                 f"(\\u{ord(source[surrogate]):04x}) on line {line}, which is no "
                                 "text; fix the template")
        environment = _environment()
        try:
            tree = environment.parse(source)
            self._template = environment.from_string(tree)
        except _jinja().TemplateSyntaxError as error:
            raise DataError(f"{self.named_as()} has a Jinja syntax error on line {error.lineno}: "
                            f"{printable(error.message or '')}; fix the template") from None
        except RecursionError:  # Jinja's parser and compiler recurse per level of nesting
            raise TemplateFailed(f"{self.named_as()} nests expressions or blocks too deep to "
                                 "compile; simplify the template") from None
        self.generation_blocks = any(
            isinstance(block.call.node, _jinja().nodes.ExtensionAttribute)
            and block.call.node.name == GENERATION_METHOD
            for block in tree.find_all(_jinja().nodes.CallBlock))

    @classmethod
    def named(cls, name_or_text: str, origin: str = "data.chat_template") -> ChatTemplate:
        """A built-in template by name ("chatml", "llama3"), else ``name_or_text`` as a
        template. Text with no Jinja tag in it is a misspelt name, not a template: DataError.
        origin: the setting that names it, for messages."""
        if name_or_text in BUILT_IN:
            return cls(BUILT_IN[name_or_text], f"{origin}={name_or_text}")
        if not re.search(r"{{|{%", name_or_text):
            raise DataError(f"chat template {printable(name_or_text)!r} is neither a built-in "
                            f"name ({', '.join(BUILT_IN)}) nor a Jinja template")
        return cls(name_or_text, origin)

    def named_as(self) -> str:
        """The template as a message names it: by where it comes from."""
        return ("the chat template" if self.origin is None else
                f"the chat template ({printable(self.origin)})")

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike[str] | Location) -> ChatTemplate | None:
        """The template saved with a Hugging Face tokenizer in the folder ``path``:
        ``chat_template.jinja`` when there is one (transformers reads it first), else the
        ``"chat_template"`` of ``tokenizer_config.json`` (a string, or a list of
        ``{"name", "template"}`` of which "default" is taken); None when there is neither.
        Either file linking out of the folder is refused (``location.model_file``)."""
        folder = location.location(path)  # a path given here enters here
        jinja_file = (folder / TEMPLATE_FILE).model_file(DataError)
        if jinja_file.is_file():
            return cls(_read(jinja_file), str(jinja_file))
        config_file = (folder / CONFIG_FILE).model_file(DataError)
        if not config_file.is_file():
            return None
        try:
            config = json.loads(_read(config_file))
        except json.JSONDecodeError as error:
            raise DataError(f"{printable(str(config_file))} is not JSON ({error}); restore "
                            "the file from the model") from None
        found = config.get("chat_template") if isinstance(config, dict) else None
        if found is None:
            return None
        if isinstance(found, list):
            named = {entry.get("name"): entry.get("template") for entry in found
                     if isinstance(entry, dict)}
            if "default" not in named:
                names = ", ".join(str(name) for name in named)
                raise DataError(f"{printable(str(config_file))} has chat templates named "
                                f"{printable(names)} but none named 'default'; name one "
                                "'default' or set the template in the data config")
            found = named["default"]
        if not isinstance(found, str):
            raise DataError(f"{printable(str(config_file))}: chat_template is a "
                            f"{type(found).__name__}, not a string; fix the file")
        return cls(found, f"chat_template of {config_file}")

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               special: Mapping[str, str] = NO_SPECIAL_TOKENS) -> str:
        """The conversation as text; with ``add_generation_prompt``, followed by what starts
        an assistant turn. ``special``: bos_token, eos_token, ... as the template reads them.
        A template that raises (``raise_exception``, an undefined name) is a DataError."""
        context = _context(messages, add_generation_prompt, special)
        try:
            return str(self._template.render(context))
        except RecursionError:
            raise self._endless() from None
        except _render_errors() as error:
            raise _refused(error) from None

    def assistant_spans(self, messages: list[dict], *,
                        special: Mapping[str, str] = NO_SPECIAL_TOKENS
                        ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character spans of it that the
        loss counts (see the module's docstring), in order."""
        if self.generation_blocks:
            return self._recorded_spans(messages, special)
        text = self.render(messages, special=special)
        spans = []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:index], add_generation_prompt=True, special=special)
            turn = self.render(messages[:index + 1], special=special)
            if not turn.startswith(prompt):
                raise _unsplittable(index, "does not start where the generation prompt ends")
            if not text.startswith(turn):
                raise _unsplittable(index, "renders differently once later messages follow")
            end = len(prompt) + len(turn[len(prompt):].rstrip())
            if end > len(prompt):
                spans.append((len(prompt), end))
        return text, spans

    def _recorded_spans(self, messages: list[dict], special: Mapping[str, str]
                        ) -> tuple[str, list[tuple[int, int]]]:
        context = _context(messages, False, special)
        recording = _Recording()
        parts = []
        reset = _RECORDING.set(recording)
        try:
            for part in self._template.generate(context):
                parts.append(part)
                recording.length += len(part)
        except RecursionError:
            raise self._endless() from None
        except _render_errors() as error:
            raise _refused(error) from None
        finally:
            _RECORDING.reset(reset)
        return "".join(parts), recording.spans

    def _endless(self) -> TemplateFailed:
        # Python's own limit stops it: the frames unwind, and the process goes on
        return TemplateFailed(f"{self.named_as()} recurses without end (a macro or include "
                              "that calls itself reached Python's recursion limit); fix the "
                              "template so that each call ends")

    def __getstate__(self) -> dict[str, str | None]:
        # a compiled template does not pickle; its text does
        return {"source": self.source, "origin": self.origin}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__dict__.update(ChatTemplate(state["source"], state.get("origin")).__dict__)

    def __repr__(self) -> str:
        name = next((key for key, text in BUILT_IN.items() if text == self.source), None)
        return f"ChatTemplate.named({name!r})" if name else f"ChatTemplate({self.source!r})"


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict],
                special: Mapping[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32) of the rendered conversation, encoded without added special tokens as
    transformers encodes chat text, and a bool mask, True on the tokens the loss counts.

    tokenizer: a ``tokenizers.Tokenizer``; one set to truncate or pad is a DataError (transformers
        turns both off for chat text, and this must not change the caller's tokenizer)."""
    encoded = encode_chats(tokenizer, template, [messages], special)[0]
    if isinstance(encoded, DataError):
        raise encoded
    return encoded


def encode_chats(tokenizer: Tokenizer, template: ChatTemplate, conversations: list[list[dict]],
                 special: Mapping[str, str]
                 ) -> list[tuple[np.ndarray, np.ndarray] | DataError]:
    """``encode_chat`` of each conversation, the texts encoded in one batch (on the tokenizer's
    own threads); a conversation the template refuses gives its DataError in its place."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        raise DataError("the tokenizer truncates or pads every text, which would cut "
                        "conversations; remove 'truncation' and 'padding' from tokenizer.json")
    rendered: list[tuple[str, list[tuple[int, int]]] | DataError] = []
    for messages in conversations:
        try:
            text, spans = template.assistant_spans(messages, special=special)
        except TemplateFailed:
            raise  # no conversation renders: not one record's fault
        except DataError as error:
            rendered.append(error)
            continue
        surrogate = _first_surrogate(text)
        if surrogate is None:
            rendered.append((text, spans))
        else:  # a special token or a value the template made: the tokenizer takes text alone
            rendered.append(DataError(
                f"the rendered conversation holds a lone UTF-16 surrogate "
                f"(\\u{ord(text[surrogate]):04x}) at character {surrogate}, which is no text; "
                "fix the record, the template or its special tokens"))
    texts = [item[0] for item in rendered if not isinstance(item, DataError)]
    encodings = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
    encoded: list[tuple[np.ndarray, np.ndarray] | DataError] = []
    for item in rendered:
        if isinstance(item, DataError):
            encoded.append(item)
            continue
        encoding = next(encodings)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        encoded.append((np.asarray(encoding.ids, dtype=np.uint32),
                        _tokens_in_spans(offsets, item[1])))
    return encoded


def _tokens_in_spans(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """True for each token whose ``[start, end)`` characters (``offsets``, ``[tokens, 2]``)
    overlap a span; a zero-width token counts when it falls strictly inside one."""
    if not spans:
        return np.zeros(len(offsets), dtype=bool)
    bounds = np.asarray(spans, dtype=np.int64)
    starts, ends = offsets[:, :1], offsets[:, 1:]
    return np.any((starts < bounds[:, 1]) & (ends > bounds[:, 0]), axis=1)


def check_messages(messages: object) -> list[dict] | str:
    """``messages`` when it is a non-empty list of ``{"role": str, "content": str}`` objects
    (other keys allowed) with at least one assistant message; else a short description of what
    is wrong, for an error that names the file and line."""
    if not isinstance(messages, list):
        return f"messages is {_kind(messages)}, not a list of {{role, content}} objects"
    if not messages:
        return "messages is an empty list"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} is {_kind(message)}, not a {{role, content}} object"
        for key in ("role", "content"):
            if key not in message:
                return f"message {index} has no {key!r}"
            if not isinstance(message[key], str):
                return f"message {index}'s {key!r} is {_kind(message[key])}, not a string"
    if not any(message["role"] == "assistant" for message in messages):
        return "no message has role 'assistant', so there is nothing to learn from"
    return messages


def _first_surrogate(text: str) -> int | None:
    """Where ``text`` holds its first lone UTF-16 surrogate (None: nowhere): the one kind of
    Python string that is not text UTF-8 can write, nor a tokenizer take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def _kind(value: object) -> str:
    name = type(value).__name__
    return "null" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _read(file: Any) -> str:
    """A template file's text, local or on object storage (its line ends read as a local
    file's are, in text mode)."""
    try:
        return file.read_text().replace("\r\n", "\n").replace("\r", "\n")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {printable(str(file))}: {printable(str(error))}") from None


def _context(messages: list[dict], add_generation_prompt: bool,
             special: Mapping[str, str]) -> dict[str, Any]:
    """What a template sees, as transformers passes it: keys whose value is None dropped from
    each message, a message's reasoning under each name templates read it by."""
    plain = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        plain.append(message)
    return {"tools": None, "documents": None, **special, "messages": plain,
            "add_generation_prompt": add_generation_prompt}


def _unsplittable(index: int, why: str) -> DataError:
    return DataError(f"the chat template needs {{% generation %}} blocks around assistant "
                     f"content: without them assistant message {index} cannot be found, as it "
                     f"{why}")


def _refused(error: Exception) -> DataError:
    what = str(error) or type(error).__name__
    return DataError(f"the chat template refused the messages: {printable(what)}; fix the record "
                     "or the template")


def _render_errors() -> tuple[type[Exception], ...]:
    """What a template's own code raises on messages it does not expect."""
    return (_jinja().TemplateError, ArithmeticError, LookupError, TypeError, ValueError)


def _jinja() -> Any:
    try:
        import jinja2
    except ImportError:
        raise DataError("chat templates need the jinja2 package, which is not installed: "
                        "pip install 'jinja2>=3.1.6'") from None
    return jinja2


@functools.cache
def _environment() -> Any:
    """The one sandboxed environment every template compiles in (its state is per render)."""
    _jinja()  # one line when jinja2 is missing
    import jinja2.ext
    import jinja2.sandbox

    version = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA:
        raise DataError(f"chat templates need jinja2>=3.1.6 (older releases let a template "
                        f"escape its sandbox), not {jinja2.__version__}: "
                        "pip install -U 'jinja2>=3.1.6'")

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(_template_globals())
    return environment


def _generation_extension() -> type:
    """The Jinja extension behind ``{% generation %}``, which marks an assistant's reply."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        """``{% generation %}body{% endgeneration %}``: renders the body and, while
        ``assistant_spans`` records, notes the characters it covers in the output."""

        tags = {"generation"}  # noqa: RUF012 (Jinja's Extension types it a plain set)

        def parse(self, parser: Any) -> Any:
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method(GENERATION_METHOD)
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(line)

        def _mark(self, caller: Any) -> str:
            text = caller()
            recording = _RECORDING.get()
            if recording is not None:
                recording.spans.append((recording.length, recording.length + len(text)))
            return str(text)

    return Generation


def _template_globals() -> dict[str, Any]:
    """What a model's chat template may call besides Jinja's own: ``raise_exception``,
    ``dict``, a ``namespace`` that refuses private names, and ``strftime_now``."""
    import jinja2.exceptions
    import jinja2.utils

    def refuse_private(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store {name!r} on a namespace (leading underscore)")

    class Namespace(jinja2.utils.Namespace):
        def __init__(self, /, *args: Any, **kwargs: Any) -> None:
            attributes = dict(*args, **kwargs)
            for name in attributes:
                refuse_private(name)
            super().__init__(attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            refuse_private(name)
            super().__setitem__(name, value)

    class DictMaker:
        """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without the type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict:
            return dict.fromkeys(*args)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    return {"raise_exception": raise_exception, "dict": DictMaker(), "namespace": Namespace,
            "strftime_now": lambda format: datetime.now().strftime(format)}


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)
