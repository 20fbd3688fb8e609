"""Chat templates render, tokenize and mask exactly as Hugging Face transformers'
apply_chat_template does (ids and assistant mask compared token for token, on ChatML and Llama-3
style templates, system prompts, several turns, non-ASCII text); a template without
{% generation %} blocks gets the same mask by rendering prefixes, or is refused in one line;
template errors and malformed messages are one line."""

from __future__ import annotations

import json
import pickle
import re
from datetime import datetime

import numpy as np
import pytest

from trainrun.data.chat import (
    CHATML,
    LLAMA3,
    ChatTemplate,
    TemplateFailed,
    check_messages,
    encode_chat,
    encode_chats,
)
from trainrun.data.pipeline import DataError

transformers = pytest.importorskip("transformers", reason="the tests' extra holds transformers")
tokenizers = pytest.importorskip("tokenizers")

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]

# Written in the style of the published ChatML (Qwen2) and Llama-3 templates, with a default
# system prompt, role checks and {% generation %} around what the assistant says. The ChatML
# one is line-oriented Jinja that relies on trim_blocks and lstrip_blocks (the blank line after
# {% endgeneration %} is the newline that ends the turn); the Llama-3 one trims with dashes.
CHATML_STYLE = r"""{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}

    {% else %}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
LLAMA3_STYLE = r"""
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system = 'Cutting Knowledge Date: December 2023' %}
    {%- set turns = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system + '<|eot_id|>' }}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
# bos and eos as each model family declares them.
TOKENS = {"chatml": {"eos_token": "<|im_end|>"},
          "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}}
STYLES = {"chatml": CHATML_STYLE, "llama3": LLAMA3_STYLE, "built-in chatml": CHATML,
          "built-in llama3": LLAMA3}
FAMILY = {"chatml": "chatml", "llama3": "llama3", "built-in chatml": "chatml",
          "built-in llama3": "llama3"}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

DIALOGUES = {
    "system, two exchanges": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Hello there, who are you?"},
        {"role": "assistant", "content": "Hello! I am a small test model."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Two plus two is four."},
    ],
    "system, three exchanges, non-ASCII": [
        {"role": "system", "content": "Réponds en français, s'il te plaît."},
        {"role": "user", "content": "Grüße aus Köln! Wie heißt du?"},
        {"role": "assistant", "content": "Ich heiße Modell — enchanté 🙂"},
        {"role": "user", "content": "日本語で話せますか。"},
        {"role": "assistant", "content": "はい、少しだけ話せます。"},
        {"role": "user", "content": "Merci beaucoup ¡adiós!"},
        {"role": "assistant", "content": "De rien, à bientôt ✨"},
    ],
    "no system, two exchanges": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, please."},
        {"role": "assistant", "content": "Green, of course."},
    ],
}


def without_generation_blocks(source: str) -> str:
    """``source`` without its generation tags, and the newline after each that trim_blocks
    dropped, so it renders the same text."""
    stripped = re.sub(r"{%-?\s*(end)?generation\s*-?%}\n?", "", source)
    assert "{% generation" not in stripped.replace("{%- ", "{% ")
    return stripped


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained on the dialogues and a few more sentences, with the chat
    special tokens; " Hello" is one token."""
    models, pre_tokenizers, decoders, trainers = (tokenizers.models, tokenizers.pre_tokenizers,
                                                   tokenizers.decoders, tokenizers.trainers)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [message["content"] for dialogue in DIALOGUES.values() for message in dialogue]
    texts += ["user: Hello there\nassistant: Hello there, Hello again"] * 20
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts * 5, trainer)
    # Adds a token to every text encoded with special tokens, which chat text must not get.
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[
            ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    return tok


def hugging_face(tok, family: str):
    """The same tokenizer, as transformers wraps it (a copy, so nothing is shared)."""
    copy = tokenizers.Tokenizer.from_str(tok.to_str())
    return transformers.PreTrainedTokenizerFast(tokenizer_object=copy, **TOKENS[family])


def reference(hf, source: str, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    out = hf.apply_chat_template(messages, chat_template=source, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    return (np.asarray(out["input_ids"], np.uint32),
            np.asarray(out["assistant_masks"], bool))


def assistant_text(messages: list[dict], family: str) -> str:
    """What the assistant turns say, end-of-turn tokens included, as the mask should select."""
    trim = str.strip if family == "llama3" else str
    return "".join(trim(m["content"]) + END_OF_TURN[family] for m in messages
                   if m["role"] == "assistant")


@pytest.mark.parametrize("dialogue", DIALOGUES)
@pytest.mark.parametrize("style", STYLES)
def test_ids_and_mask_match_transformers(tokenizer, style, dialogue):
    family, messages = FAMILY[style], DIALOGUES[dialogue]
    hf = hugging_face(tokenizer, family)
    template = ChatTemplate(STYLES[style])
    assert template.generation_blocks
    ids, mask = encode_chat(tokenizer, template, messages, hf.special_tokens_map)
    want_ids, want_mask = reference(hf, STYLES[style], messages)
    assert ids.dtype == np.uint32 and mask.dtype == bool
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    # The mask selects what the assistant says and its end-of-turn token, and nothing else.
    assert tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False) == \
        assistant_text(messages, family)
    assert ids.size == len(tokenizer.encode(template.render(messages, special=TOKENS[family]),
                                            add_special_tokens=False).ids)


@pytest.mark.parametrize("style", STYLES)
def test_generation_prompt_renders_as_transformers_does(tokenizer, style):
    family = FAMILY[style]
    hf = hugging_face(tokenizer, family)
    for messages in DIALOGUES.values():
        asked = messages[:-1]
        text = ChatTemplate(STYLES[style]).render(asked, add_generation_prompt=True,
                                                  special=hf.special_tokens_map)
        assert text == hf.apply_chat_template(asked, chat_template=STYLES[style],
                                              tokenize=False, add_generation_prompt=True)
        header = {"chatml": "<|im_start|>assistant\n",
                  "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n"}[family]
        assert text.endswith(END_OF_TURN[family] + ("\n" if family == "chatml" else "") + header)


@pytest.mark.parametrize("dialogue", DIALOGUES)
@pytest.mark.parametrize("style", STYLES)
def test_rendering_prefixes_finds_the_spans_generation_blocks_mark(tokenizer, style, dialogue):
    family, messages = FAMILY[style], DIALOGUES[dialogue]
    special = hugging_face(tokenizer, family).special_tokens_map
    marked = ChatTemplate(STYLES[style])
    plain = ChatTemplate(without_generation_blocks(STYLES[style]))
    assert not plain.generation_blocks
    text, spans = marked.assistant_spans(messages, special=special)
    assert plain.assistant_spans(messages, special=special) == (text, spans)
    assert len(spans) == sum(m["role"] == "assistant" for m in messages)
    marked_ids, marked_mask = encode_chat(tokenizer, marked, messages, special)
    ids, mask = encode_chat(tokenizer, plain, messages, special)
    np.testing.assert_array_equal(ids, marked_ids)
    np.testing.assert_array_equal(mask, marked_mask)
    assert mask.any() and not mask.all()


def test_built_in_templates_render_the_published_formats(tokenizer):
    messages = DIALOGUES["system, two exchanges"][:3]
    assert ChatTemplate.named("chatml").source == CHATML
    assert ChatTemplate.named("chatml").render(messages) == (
        "<|im_start|>system\nYou answer in one short sentence.<|im_end|>\n"
        "<|im_start|>user\nHello there, who are you?<|im_end|>\n"
        "<|im_start|>assistant\nHello! I am a small test model.<|im_end|>\n")
    assert ChatTemplate.named("llama3").render(messages[:2], add_generation_prompt=True,
                                               special=TOKENS["llama3"]) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "You answer in one short sentence.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello there, who are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Masks: covered with the other styles in test_ids_and_mask_match_transformers.
    text, spans = ChatTemplate.named("llama3").assistant_spans(messages, special=TOKENS["llama3"])
    assert [text[a:b] for a, b in spans] == ["Hello! I am a small test model.<|eot_id|>"]


def test_named_takes_template_text_and_refuses_a_misspelt_name():
    assert ChatTemplate.named("{{ messages[0]['content'] }}!").render(
        [{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(DataError, match=r"'chatm1' is neither a built-in name \(chatml, llama3"):
        ChatTemplate.named("chatm1")


def test_a_token_that_starts_before_a_span_counts(tokenizer):
    """Byte-level BPE keeps a word's leading space in its token; transformers counts the token
    " Hello" when the span starts at "H", and so must encode_chat."""
    source = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}"
              "{% endif %}\n{% endfor %}")
    messages = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hello again"}]
    template = ChatTemplate(source)
    text, spans = template.assistant_spans(messages)
    ids, mask = encode_chat(tokenizer, template, messages, {})
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    straddling = [i for i, (a, b) in enumerate(offsets) if a < spans[0][0] < b]
    assert straddling and mask[straddling[0]]  # " Hello": starts on the space, before the span
    assert tokenizer.decode(ids[mask].tolist()) == " Hello again"
    want_ids, want_mask = reference(hugging_face(tokenizer, "chatml"), source, messages)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)


@pytest.mark.parametrize(("source", "why"), [
    # The generation prompt opens a thinking block that history turns do not have.
    (without_generation_blocks(CHATML).replace("'<|im_start|>assistant\\n'",
                                               "'<|im_start|>assistant\\n<think>\\n'"),
     "message 2 cannot be found, as it does not start where the generation prompt ends"),
    # An assistant turn renders differently once later turns follow it.
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
     "{% if loop.last and m['role'] == 'assistant' %} (final){% endif %}\n{% endfor %}",
     "message 2 cannot be found, as it renders differently once later messages follow"),
])
def test_a_template_that_prefixes_cannot_split_is_refused_in_one_line(source, why):
    messages = DIALOGUES["system, two exchanges"]
    with pytest.raises(DataError, match=re.escape("needs {% generation %} blocks")) as error:
        ChatTemplate(source).assistant_spans(messages)
    assert why in str(error.value) and "\n" not in str(error.value)


def test_template_errors_are_one_line(tokenizer):
    unordered = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                 {"role": "assistant", "content": "c"}]
    template = ChatTemplate(LLAMA3_STYLE)
    for call in (lambda: template.render(unordered, special=TOKENS["llama3"]),
                 lambda: encode_chat(tokenizer, template, unordered, TOKENS["llama3"])):
        with pytest.raises(DataError, match="roles must alternate") as error:
            call()
        assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="syntax error on line 2") as error:
        ChatTemplate("{% for m in messages %}\n{{ m['content'] }\n")
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="refused the messages") as error:
        ChatTemplate("{{ raise_exception('line one\nline two') }}").render([])
    assert "\n" not in str(error.value)
    with pytest.raises(DataError, match="refused the messages: can only concatenate str"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(unordered)


def test_the_sandbox_refuses_what_transformers_refuses(tokenizer):
    hf = hugging_face(tokenizer, "chatml")
    messages = [{"role": "user", "content": "hi"}]
    for source in ("{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
                   "{{ messages.__class__.__mro__ }}",
                   "{{ messages.append(1) }}"):
        with pytest.raises(DataError, match="refused the messages"):
            ChatTemplate(source).render(messages)
        with pytest.raises(Exception):  # noqa: B017 (transformers raises Jinja's own errors)
            hf.apply_chat_template(messages, chat_template=source, tokenize=False)


def test_filters_and_globals_match_transformers(tokenizer):
    hf = hugging_face(tokenizer, "chatml")
    messages = [{"role": "user", "content": '<b>Grüße</b> & "日本" 🙂'},
                {"role": "assistant", "content": "ok", "reasoning": "think", "name": None}]
    source = ("{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}|"
              "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
              "{{ m.role }}{% endfor %}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') }}")
    text = ChatTemplate(source).render(messages)
    assert text == hf.apply_chat_template(messages, chat_template=source, tokenize=False)
    assert '<b>Grüße</b> & \\"日本\\" 🙂' in text  # neither HTML- nor ASCII-escaped
    assert '"reasoning_content": "think"' in text and '"name"' not in text
    assert text.endswith(f"|user|{{\"a\": 1}}|{datetime.now().year}")


def test_from_model_dir_reads_what_transformers_saves(tokenizer, tmp_path):
    hf = hugging_face(tokenizer, "chatml")
    hf.chat_template = CHATML_STYLE
    hf.save_pretrained(tmp_path / "saved")
    assert ChatTemplate.from_model_dir(tmp_path / "saved").source == CHATML_STYLE

    def model_dir(name: str, config: object = None, jinja: str | None = None):
        folder = tmp_path / name
        folder.mkdir()
        if config is not None:
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
        if jinja is not None:
            (folder / "chat_template.jinja").write_text(jinja)
        return folder

    string = model_dir("string", {"chat_template": LLAMA3_STYLE})
    assert ChatTemplate.from_model_dir(string).source == LLAMA3_STYLE
    listed = model_dir("list", {"chat_template": [{"name": "tool_use", "template": "{{ 1 }}"},
                                                  {"name": "default", "template": CHATML}]})
    assert ChatTemplate.from_model_dir(listed).source == CHATML
    both = model_dir("both", {"chat_template": "{{ 1 }}"}, jinja=LLAMA3)
    assert ChatTemplate.from_model_dir(both).source == LLAMA3  # transformers reads this first
    assert ChatTemplate.from_model_dir(model_dir("none", {"bos_token": "<s>"})) is None
    assert ChatTemplate.from_model_dir(model_dir("empty")) is None
    undefaulted = model_dir("no default", {"chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(DataError, match="named rag but none named 'default'"):
        ChatTemplate.from_model_dir(undefaulted)
    broken = model_dir("broken")
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match="is not JSON"):
        ChatTemplate.from_model_dir(broken)


def test_a_template_pickles_as_its_text():
    template = pickle.loads(pickle.dumps(ChatTemplate.named("llama3")))
    messages = DIALOGUES["system, two exchanges"]
    assert template.source == LLAMA3
    assert template.assistant_spans(messages) == \
        ChatTemplate(LLAMA3).assistant_spans(messages)


def test_a_tokenizer_that_truncates_is_refused(tokenizer):
    truncating = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    truncating.enable_truncation(8)
    with pytest.raises(DataError, match="truncates or pads"):
        encode_chat(truncating, ChatTemplate(CHATML), DIALOGUES["system, two exchanges"], {})


@pytest.mark.parametrize(("messages", "problem"), [
    ({"role": "user", "content": "hi"}, "messages is a dict, not a list"),
    (None, "messages is null"),
    ([], "empty list"),
    (["hi"], "message 0 is a str"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"content": "hi"}], "message 0 has no 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
     "message 1's 'content' is null"),
    ([{"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
     "message 0's 'content' is a list"),
    ([{"role": 1, "content": "a"}], "message 0's 'role' is an int"),
    ([{"role": "user", "content": "a"}], "no message has role 'assistant'"),
])
def test_check_messages_names_what_is_wrong(messages, problem):
    found = check_messages(messages)
    assert isinstance(found, str) and problem in found


def test_check_messages_returns_good_messages():
    messages = DIALOGUES["system, two exchanges"] + [{"role": "user", "content": "x", "id": 3}]
    assert check_messages(messages) is messages


ENDLESS = "{% macro turn(m) %}{{ turn(m) }}{% endmacro %}{% for m in messages %}{{ turn(m) }}" \
          "{% endfor %}"


def test_a_template_that_recurses_without_end_is_refused_as_a_template(tokenizer, tmp_path):
    """Python's recursion limit stops the render; the template is refused in one line naming
    where it comes from, for any conversation (not one bad record among good ones), with or
    without {% generation %} blocks."""
    messages = DIALOGUES["system, two exchanges"]
    marked = ENDLESS.replace("{{ turn(m) }}{% endfor", "{% generation %}{{ turn(m) }}"
                                                        "{% endgeneration %}{% endfor")
    for template in (ChatTemplate.named(ENDLESS), ChatTemplate.named(marked)):
        for refused in (lambda t: t.render(messages),
                        lambda t: encode_chats(tokenizer, t, [messages, messages], {})):
            with pytest.raises(TemplateFailed) as error:
                refused(template)
            line = str(error.value)
            assert line.startswith("the chat template (data.chat_template) recurses without "
                                   "end") and "fix the template" in line and "\n" not in line
    (tmp_path / "chat_template.jinja").write_text(ENDLESS)
    with pytest.raises(TemplateFailed, match=re.escape(
            f"the chat template ({tmp_path / 'chat_template.jinja'}) recurses without end")):
        ChatTemplate.from_model_dir(tmp_path).render(messages)


def test_a_template_that_cannot_be_text_or_compiled_is_refused_in_one_line():
    with pytest.raises(TemplateFailed, match=re.escape(
            r"the chat template (data.chat_template) holds a lone UTF-16 surrogate (\ud800) on "
            "line 2")) as error:
        ChatTemplate.named("{{ messages[0]['content'] }}\n\ud800{{ 1 }}")
    assert "\n" not in str(error.value)
    deep = "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}"
    with pytest.raises(TemplateFailed, match="nests expressions or blocks too deep to compile"):
        ChatTemplate(deep)


def test_a_rendered_conversation_that_is_no_text_is_that_records_error(tokenizer):
    """A special token with a lone surrogate (from a tokenizer_config.json's escapes) reaches
    the rendered text; the tokenizer cannot take it, so that conversation is refused."""
    template = ChatTemplate("{{ bos_token }}" + CHATML)
    [encoded] = encode_chats(tokenizer, template, [DIALOGUES["system, two exchanges"]],
                             {"bos_token": "\udfff"})
    assert isinstance(encoded, DataError)
    assert r"holds a lone UTF-16 surrogate (\udfff) at character 0" in str(encoded)
