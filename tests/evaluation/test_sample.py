"""Sampling: the cached decoder gives what recomputing the whole text would; an answer stops
where the model's context ends, and says so; one compile per call; and `trainrun sample` on a
trained run."""

from __future__ import annotations

import io
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import own_loop_answer, save_tiny_chat_model, traced

import trainrun
from trainrun import rundir
from trainrun.checkpointing.reader import latest_params
from trainrun.cli import main
from trainrun.config import TransformerModel, dump_yaml, load_config
from trainrun.evaluation.sample import SampleError
from trainrun.fast import strategies
from trainrun.models import build_model
from trainrun.models.transformer import bind_transformer
from trainrun.program.decode import ContextWarning, decoder, generate, generate_batch
from trainrun.training.loop import run

CFG = TransformerModel(d_model=32, layers=2, heads=4, seq_len=16)
LONG = CFG.model_copy(update={"seq_len": 64})  # the same params, a longer context


def recomputed(params, prompt: np.ndarray, tokens: int, cfg: TransformerModel = CFG
               ) -> list[int]:
    """Greedy decoding by a full forward pass over the whole text for every token: the last
    seq_len - 1 prompt bytes, then the answer, up to ``tokens`` or the end of the context."""
    window = cfg.seq_len
    module_of = bind_transformer(cfg)

    @jax.jit
    def logits_at(padded, last):  # causal: the padding after `last` changes nothing before it
        return module_of(params)(padded[None])[0][0, last]

    context, out = list(prompt[-(window - 1):]), list(prompt)
    while len(out) < len(prompt) + tokens and len(context) < window:
        padded = jnp.asarray(context + [0] * (window - len(context)), jnp.int32)
        token = int(jnp.argmax(logits_at(padded, len(context) - 1)))
        out.append(token)
        context.append(token)
    return out


@pytest.mark.slow
def test_cached_decoding_equals_recomputing_the_context_in_one_program():
    params = build_model(CFG).init(jax.random.key(0))
    prompt = np.frombuffer(b"import os\n", np.uint8)
    decoder.cache_clear()  # the decoder of this shape is made, and traced, in this test
    with traced() as programs:
        got = generate(LONG, params, prompt, 30, temperature=0.0)
        a, b, c = (generate(LONG, params, prompt, 30, temperature=1.0, seed=s)
                   for s in (1, 1, 2))
    assert got.tolist() == recomputed(params, prompt, 30, LONG)
    assert len(got) == 40
    assert bytes(got[:10].astype(np.uint8)) == b"import os\n"
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # one program for any token, seed and temperature above 0, one greedy
    assert programs.count("decode") == 2


def test_greedy_decoding_compiles_no_sampler():
    """At temperature 0 the decoder holds no random bits: their compile is not paid, and the
    answer is the argmax whatever the key."""
    params = build_model(CFG).init(jax.random.key(0))
    args = (params, jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32), jnp.float32(0.0),
            jax.random.key(0), jnp.array([-1], jnp.int32))
    greedy, sampled = (str(jax.make_jaxpr(decoder(CFG, 2, 4, 6, sampled=on))(*args))
                       for on in (False, True))
    assert "random_bits" in sampled and "random_bits" not in greedy
    prompt = np.frombuffer(b"def f(", np.uint8)
    assert generate(CFG, params, prompt, 8, temperature=0.0, seed=1).tolist() == generate(
        CFG, params, prompt, 8, temperature=0.0, seed=2).tolist() == recomputed(params, prompt, 8)

    compiled: list[str] = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(listen)
    generate_batch(CFG, params, [prompt[:3], prompt], 7, temperature=0.0, seed=3)
    assert compiled == ["jit(decode)"]  # no small program to fold a key or place an array


def as_text(ids: np.ndarray) -> str:
    """Byte ids as ``trainrun sample`` prints them."""
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@pytest.mark.slow
def test_sample_command_prints_text_from_the_latest_checkpoint(tmp_path, capsys):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=40", "steps_per_call=20", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=5", "optimizer.lr=0.01",
        "model.d_model=32", "model.layers=1", "model.heads=2", "model.seq_len=32",
        f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=8"])
    run(config, tmp_path / "lm", out=io.StringIO())

    assert main(["sample", str(tmp_path / "lm"), "--prompt", "def ", "--tokens", "24",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    step, params = latest_params(tmp_path / "lm", config)
    expected = generate(config.model, params, np.frombuffer(b"def ", np.uint8), 24,
                        temperature=0.0)
    assert step == 40 and text == bytes(expected.astype(np.uint8)).decode() + "\n"
    assert set(text[4:]) - {" ", "\n"}  # more than blanks: it learned some of the corpus

    # Past the 32-byte rows: rotary positions read on, every token attending to the whole
    # text (before, decoding went on from the last 16 bytes, without a word).
    prompt = np.frombuffer(b"def ", np.uint8)
    whole = trainrun.load(tmp_path / "lm").generate(prompt, 60)
    assert len(whole) == 64
    assert isinstance(config.model, TransformerModel)
    assert whole.tolist() == generate(config.model.model_copy(update={"seq_len": 64}), params,
                                      prompt, 60, temperature=0.0).tolist()
    assert main(["sample", str(tmp_path / "lm"), "--prompt", "def ", "--tokens", "60"]) == 0
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == (as_text(whole) + "\n", "")
    assert main(["sample", str(tmp_path / "lm"), "--prompt", "def ", "--tokens", "60",
                 "--context", "40"]) == 0
    captured = capsys.readouterr()
    assert captured.out == as_text(whole[:40]) + "\n"
    assert captured.err.startswith("warning: the answer stopped before 60 tokens: the model "
                                   "reads 40 positions") and captured.err.count("\n") == 1
    assert main(["sample", str(tmp_path / "lm"), "--context", "1"]) == 2
    assert capsys.readouterr().err == ("error: context=1: give a number of positions above "
                                       "1\n")

    (tmp_path / "mlp").mkdir()
    (tmp_path / "mlp" / rundir.CONFIG).write_text(dump_yaml(load_config("mlp")))
    assert main(["sample", str(tmp_path / "mlp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sampling needs a language model" in err[0]
    assert main(["sample", str(tmp_path / "lm"), "--chat", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat needs a run on chat records" in err[0]
    assert main(["sample", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_sample_reads_an_export_as_the_run_it_came_from(tmp_path, capsys, lora):
    """Before: "<export> is not a run directory (no config.yaml)"."""
    source = save_tiny_chat_model(tmp_path / "model")
    adapters = ["model.lora={targets: all-linear}"] if lora else []
    assert main(["train", "--config", "finetune", "--run-dir", str(tmp_path / "run"),
                 f"init.from={source}", "data.kind=records", "data.synthetic=reverse",
                 "data.format=chat", "data.synthetic_examples=256", "steps=2",
                 "steps_per_call=1", "eval.every=0", "checkpoint.every=2", *adapters]) == 0
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    asked = [("--chat", "reverse abc"), ("--prompt", "ab")]
    for option, text in asked:
        said = []
        for path in (tmp_path / "run", tmp_path / "export"):
            assert main(["sample", str(path), option, text, "--tokens", "12",
                         "--temperature", "1", "--seed", "3"]) == 0
            said.append(capsys.readouterr().out)
        assert said[0] == said[1] and said[0] not in ("\n", text + "\n"), (option, said)
    assert main(["sample", str(tmp_path / "export"), "--ema"]) == 2
    assert "only a run keeps a moving average" in capsys.readouterr().err


@pytest.mark.slow
def test_sample_command_on_a_lora_run(tmp_path, capsys):
    # The decoder is cached per model config, which holds the adapters' targets: it must hash.
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=4", "steps_per_call=2", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1", "optimizer.lr=0.01", "model.d_model=32",
        "model.layers=1", "model.heads=2", "model.seq_len=32",
        "model.lora={rank: 4, alpha: 8, targets: [q, v, up]}",
        f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=8"])
    run(config, tmp_path / "lora", out=io.StringIO())

    assert main(["sample", str(tmp_path / "lora"), "--prompt", "def ", "--tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def ") and len(captured.out) > len("def \n")
    assert captured.err == ""


@pytest.mark.slow
def test_any_token_count_from_one_and_any_prompt_length_decodes_and_zero_is_refused():
    params = build_model(CFG).init(jax.random.key(0))
    for prompt, tokens in ((b"def ", 1), (b"def ", 3), (b"x" * 15, 1), (b"x" * 40, 2)):
        ids = np.frombuffer(prompt, np.uint8)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = generate(CFG, params, ids, tokens, temperature=0.0)
        assert got.tolist() == recomputed(params, ids, tokens)
        # 40 bytes: the prompt keeps its last 15, and the answer its one position left
        assert [str(w.message).split(":")[0] for w in said] == (
            ["the prompt was cut to its last 15 tokens and the answer stopped before 2 tokens"]
            if len(prompt) == 40 else [])
    for tokens in (0, -1):
        try:
            generate(CFG, params, np.frombuffer(b"def ", np.uint8), tokens)
        except SampleError as err:
            assert "at least 1 token" in str(err)
        else:
            raise AssertionError(f"--tokens {tokens} was accepted")


@pytest.mark.slow
def test_a_system_prompt_and_a_file_of_conversations_are_answered_as_an_own_loop_would(
        chat_run, tmp_path, capsys):
    from trainrun.evaluation.sample import chat_answers

    run_dir, config = chat_run
    system, question = "Answer in one word.", "reverse: abc"
    with_system = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    [answer] = chat_answers(run_dir, [question], 12, temperature=0.0, system=system)
    assert answer == own_loop_answer(run_dir, config, with_system, 12)
    # the system turn reached the model: without it, the same run answers otherwise
    assert answer != own_loop_answer(run_dir, config, with_system[1:], 12)
    assert main(["sample", str(run_dir), "--chat", question, "--system", system,
                 "--temperature", "0", "--tokens", "12"]) == 0
    assert capsys.readouterr().out == answer + "\n"

    conversations = [with_system, [{"role": "user", "content": "reverse: xyz"}],
                     [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}]]
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations) + "\n")
    # a batch answers each conversation as it is answered alone
    assert main(["sample", str(run_dir), "--file", str(path), "--temperature", "0",
                 "--tokens", "4"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["messages"] for line in lines] == conversations
    assert [line["answer"] for line in lines] == [
        own_loop_answer(run_dir, config, c, 4) for c in conversations]
    assert len({line["answer"] for line in lines}) > 1


@pytest.mark.slow
@pytest.mark.parametrize(("args", "lines", "says"), [
    (["--system", "be brief"], None, "a system prompt (--system) goes with a chat turn"),
    (["--chat", "hi"], ['{"messages": [{"role": "user", "content": "x"}]}'],
     "--chat and --file both give the turns"),
    ([], ['{"messages": [{"role": "user", "content": "x"}, '
          '{"role": "assistant", "content": "y"}]}'], "line 1: a conversation ends with the"),
    ([], ["not json"], 'line 1 is not a JSON object with "messages"'),
    ([], [""], "holds no conversation"),
    (["--system", "s"], ['{"messages": [{"role": "system", "content": "t"}, '
                         '{"role": "user", "content": "x"}]}'], "drop one of them"),
])
def test_bad_chat_input_is_one_line_and_exit_2(chat_run, tmp_path, capsys, args, lines, says):
    run_dir, _ = chat_run
    extra = []
    if lines is not None:
        (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
        extra = ["--file", str(tmp_path / "c.jsonl")]
    assert main(["sample", str(run_dir), *args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_batch_of_prompts_of_different_lengths_answers_each_as_alone_with_one_compile():
    params = build_model(CFG).init(jax.random.key(0))
    prompts = [np.frombuffer(text, np.uint8) for text in (b"ab", b"import", b"x = 1\n", b"d")]
    alone = [generate(CFG, params, p, 9, temperature=0.0)[p.size:] for p in prompts]
    assert len({a.tobytes() for a in alone}) > 1  # the prompts lead to different answers
    decoder.cache_clear()  # the batch's decoder is made, and traced, here
    with traced() as programs:
        got = generate_batch(CFG, params, prompts, 9, temperature=0.0, batch_size=3)
    assert [g.tolist() for g in got] == [a.tolist() for a in alone]
    # 4 prompts in batches of 3: one program for both batches, whatever their lengths
    assert programs.count("decode") == 1
    # Each row stops at its own stop id: the first id the second prompt's answer draws.
    stop = int(alone[1][2])
    stopped = generate_batch(CFG, params, prompts, 9, temperature=0.0, stop_ids=[stop])
    for answer, full in zip(stopped, alone, strict=True):
        ends = np.flatnonzero(full == stop)
        assert answer.tolist() == full[:ends[0] + 1 if ends.size else None].tolist()
    assert len(stopped[1]) <= 3


def test_answers_stop_where_the_context_ends_and_say_so():
    """Before, the decoder went on from the last half of a full context, without a word, and
    departed from what the model computes over the whole text."""
    params = build_model(CFG).init(jax.random.key(0))
    texts = (b"def", b"import os\n", b"x=2", b"ab")
    prompts = [np.frombuffer(text, np.uint8) for text in texts]
    with pytest.warns(ContextWarning, match="^4 of 4 answers stopped before 30 tokens: the "
                                            "model reads 16 positions"):
        got = generate_batch(CFG, params, prompts, 30, temperature=0.0)
    assert [g.tolist() for g in got] == [recomputed(params, p, 30)[p.size:] for p in prompts]
    assert [len(g) for g in got] == [16 - p.size for p in prompts]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the context nothing is said
        longer = generate_batch(LONG, params, prompts, 30, temperature=0.0)
    assert [g.tolist() for g in longer] == [recomputed(params, p, 30, LONG)[p.size:]
                                            for p in prompts]
    assert {len(g) for g in longer} == {30}


def test_sampled_batches_follow_the_seed():
    params = build_model(CFG).init(jax.random.key(0))
    prompts = [np.frombuffer(text, np.uint8) for text in (b"ab", b"import")]
    a, b, c = (generate_batch(CFG, params, prompts, 8, temperature=1.0, seed=s)
               for s in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_decoding_gives_the_same_tokens_with_the_head_layout_fast_path_off():
    params = build_model(CFG).init(jax.random.key(0))
    prompts = [np.frombuffer(text, np.uint8) for text in (b"ab", b"import", b"x = 1\n")]
    on, off = (generate_batch(LONG, params, prompts, 12, temperature=0.0,
                              head=strategies.chosen(environ).decode_head())
               for environ in ({}, {"TRAINRUN_FAST_PATHS": "none"}))
    assert [a.tolist() for a in on] == [b.tolist() for b in off]


@pytest.mark.slow
def test_sample_is_greedy_unless_a_temperature_is_given(chat_run, capsys):
    """A chat answer, or a continued prompt, is the same whatever the seed, and is the most
    likely tokens' (what `eval` answers); --temperature samples."""
    run_dir, config = chat_run
    question = "reverse: abc"
    greedy = own_loop_answer(run_dir, config, [{"role": "user", "content": question}], 12)
    for seed in ("0", "7"):
        assert main(["sample", str(run_dir), "--chat", question, "--tokens", "12",
                     "--seed", seed]) == 0
        assert capsys.readouterr().out == greedy + "\n"
    texts = []
    for seed in ("0", "7"):
        assert main(["sample", str(run_dir), "--prompt", "a", "--tokens", "12",
                     "--seed", seed]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert main(["sample", str(run_dir), "--chat", question, "--tokens", "12",
                 "--temperature", "5", "--seed", "7"]) == 0
    assert capsys.readouterr().out != greedy + "\n"
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    assert "0 = greedy, the most likely token each time (the default" in " ".join(
        capsys.readouterr().out.split())


def test_a_conversations_file_that_never_ends_is_refused_in_one_line(tmp_path, capsys,
                                                                    monkeypatch):
    """Before, the file was read whole: /dev/zero until memory ran out."""
    import trainrun.evaluation.sample

    assert main(["sample", str(tmp_path / "never-read"), "--file", "/dev/zero"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/dev/zero holds more than 64 MiB (or never ends)" in err[0], err
    monkeypatch.setattr(trainrun.evaluation.sample, "CONVERSATIONS_MAX_BYTES", 100)
    big = tmp_path / "big.jsonl"
    big.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 3)
    assert main(["sample", str(tmp_path / "never-read"), "--file", str(big)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{big} holds more than" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize(("args", "says"), [
    (["--chat", "hi", "--system", "\udcff\udcfe"], "--system is not UTF-8 text"),
    (["--chat", "a\udcff"], "--chat is not UTF-8 text"),
    (["--prompt", "\udcff"], "--prompt is not UTF-8 text"),
    (["--file", "FILE", "--system", "\udcff"], "--system is not UTF-8 text"),
    (["--file", "BAD"], "line 1: turn 1's content is not UTF-8 text"),
])
def test_text_that_is_not_utf8_is_refused_in_one_line(chat_run, tmp_path, capsys, args, says):
    """Bytes that are not UTF-8 on the command line (Python holds them as lone surrogates)
    and a lone surrogate escaped in a conversation's JSON: before, a TypeError from the
    tokenizer or a UnicodeEncodeError."""
    run_dir, _ = chat_run
    files = {"FILE": "x", "BAD": "x\\udcff"}
    for name, content in files.items():
        turn = f'{{"role": "user", "content": "{content}"}}'
        (tmp_path / name).write_text(f'{{"messages": [{turn}]}}\n')
    args = [str(tmp_path / a) if a in files else a for a in args]
    assert main(["sample", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
