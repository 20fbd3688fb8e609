"""Record sources: JSONL and Parquet read as a stream, bad records refused or counted, the
model's own tokenizer, loss masks on the answers, and rows that a run reads like any other."""

from __future__ import annotations

import errno
import gzip
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import RecordsData, TransformerModel, config_from_dict
from trainrun.data import DataError, build_dataset, build_eval_dataset
from trainrun.data.model_tokenizer import byte_tokenizer
from trainrun.data.record_rows import record_splits
from trainrun.models.transformer import make_transformer


@pytest.fixture(autouse=True)
def record_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))


def chat(i: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": "answer briefly"}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i}.{t}"},
                     {"role": "assistant", "content": f"answer {i}.{t} é"}]
    return {"messages": messages}


def write_jsonl(path: Path, records, extra_lines=()) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        for line in extra_lines:
            out.write(line)
    return path


def segments(rows: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every packed example of ``rows``: (its tokens, its loss mask), sorted."""
    found = []
    for r in range(len(rows["tokens"])):
        seg = np.asarray(rows["segment_ids"][r])
        for s in range(1, int(seg.max()) + 1):
            at = seg == s
            found.append((tuple(np.asarray(rows["tokens"][r])[at].tolist()),
                          tuple(np.asarray(rows["loss_mask"][r])[at].tolist())))
    return sorted(found)


def data(tmp_path, **settings) -> RecordsData:
    return RecordsData(**{"seq_len": 64, "batch_size": 4, "eval_fraction": 0.0, **settings})


# ---- reading ----------------------------------------------------------------------------------


def test_jsonl_gzip_and_parquet_give_the_same_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    records = [chat(i) for i in range(40)]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    zipped = write_jsonl(tmp_path / "a.jsonl.gz", records)
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=7)
    rows = [record_splits(data(tmp_path, paths=(str(p),)))["train"]
            for p in (plain, zipped, tmp_path / "a.parquet")]
    assert len(segments(rows[0])) == 40
    for other in rows[1:]:
        for name in rows[0]:
            np.testing.assert_array_equal(rows[0][name], other[name])


@pytest.mark.parametrize("line, what", [
    ('{"messages": [{"role": "user"}]}\n', "content"),
    ("{not json}\n", "not valid JSON"),
    (b"\xff\xfe{}\n", "not UTF-8"),
    ('[1, 2]\n', "a list, not a JSON object"),
    ('{"text": "no messages here"}\n', "no 'messages' field"),
    ('{"messages": "hello"}\n', "messages"),
    # What Python's json would crash on, or read into what no tokenizer takes
    ('{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}\n",
     "nested more than 500 levels deep"),
    ('{"id": ' + "9" * 5000 + ', "messages": []}\n', "an integer of more than 4300 digits"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}, '
     '{"role": "assistant", "content": "a"}]}\n',
     r"field messages[0].content holds a lone UTF-16 surrogate (\ud800"),
    ('{"messages": [], "\\udc00": 1}\n', r"a key of the record holds a lone UTF-16 surrogate"),
])
def test_a_bad_record_is_refused_naming_its_file_and_line(tmp_path, line, what):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(0), chat(1)])
    with open(path, "ab") as out:
        out.write(line if isinstance(line, bytes) else line.encode())
    with pytest.raises(DataError) as err:
        record_splits(data(tmp_path, paths=(str(path),)))
    message = str(err.value)
    assert f"{path}:3" in message and what in message, message
    assert "data.bad_records=skip" in message and "\n" not in message
    assert not list((tmp_path / "cache" / "records").glob("*/manifest.json"))  # nothing kept


def test_preference_pairs_read_as_other_records_name_the_format_that_reads_them(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError) as err:
        record_splits(data(tmp_path, paths=(str(path),)))
    assert f"{path}:1: is a preference pair: set data.format=preference" in str(err.value)


def test_records_json_would_crash_on_are_skipped_and_counted(tmp_path):
    """Under data.bad_records=skip the records nested too deep, with a 5,000-digit integer or a
    lone surrogate are counted and left out; an escaped surrogate pair (an emoji) is text."""
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(6)], extra_lines=[
        '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}\n",
        '{"n": ' + "1" * 5000 + "}\n",
        '{"messages": [{"role": "user", "content": "\\udfff"}]}\n',
        '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, '
        '{"role": "assistant", "content": "\\\\ud800 is an escape"}]}\n'])
    splits = record_splits(data(tmp_path, paths=(str(path),), bad_records="skip"))
    counts = splits["counts"]
    assert (counts.records, counts.skipped, counts.examples) == (10, 3, 7)
    assert [bad.split(": ", 1)[0] for bad in counts.bad] == [f"{path}:{n}" for n in (7, 8, 9)]
    emoji = "\N{GRINNING FACE}".encode()
    texts = [bytes(t for t in tokens if t < 256) for tokens, _ in segments(splits["train"])]
    assert sum(emoji in text for text in texts) == 1  # one token per byte: the emoji's bytes


def test_parquet_strings_that_are_not_utf8_are_named_by_row_and_column(tmp_path):
    """Arrow checks no UTF-8 as it reads a Parquet file's strings: such a row is a bad record,
    refused or skipped, not a UnicodeDecodeError."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # "\ud800" as CESU-8 bytes: what a writer that does not check would store for it
    texts = [b"fine one", b"\xed\xa0\x80 half a character", b"fine two"]
    column = pa.array(texts, type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": column}), tmp_path / "texts.parquet")
    path = str(tmp_path / "texts.parquet")
    with pytest.raises(DataError, match=re.escape(
            f"record {path} row 2: column 'text' holds a string that is not UTF-8")):
        record_splits(data(tmp_path, paths=(path,)))
    counts = record_splits(data(tmp_path, paths=(path,), bad_records="skip"))["counts"]
    assert (counts.records, counts.skipped, counts.examples) == (3, 1, 2)


def test_a_template_that_recurses_without_end_refuses_the_run_whatever_the_policy(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(4)])
    endless = "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"
    for policy in ("refuse", "skip"):
        with pytest.raises(DataError, match=re.escape(
                "the chat template (data.chat_template) recurses without end")):
            record_splits(data(tmp_path, paths=(str(path),), chat_template=endless,
                               bad_records=policy))


def test_a_bad_parquet_row_is_named_by_its_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": "p", "completion": "c"}] * 5 + [{"prompt": "p", "completion": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet", row_group_size=4)
    with pytest.raises(DataError, match=r"pairs.parquet row 6: field 'completion' is null"):
        record_splits(data(tmp_path, paths=(str(tmp_path / "pairs.parquet"),)))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"cannot read .*junk\.parquet.* as Parquet"):
        record_splits(data(tmp_path, paths=(str(tmp_path / "junk.parquet"),)))


def test_skipped_records_are_counted_and_the_rest_train(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(10)],
                       extra_lines=["{cut", "\n", '{"messages": []}\n', "3\n"])
    splits = record_splits(data(tmp_path, paths=(str(path),), bad_records="skip"))
    counts = splits["counts"]
    assert (counts.records, counts.skipped, counts.examples) == (13, 3, 10)
    assert f"{path}:11" in counts.bad[0]
    assert len(segments(splits["train"])) == 10


def test_a_cut_gzip_file_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl.gz", [chat(i) for i in range(200)])
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DataError, match="not a whole gzip file"):
        record_splits(data(tmp_path, paths=(str(path),)))


def test_too_long_examples_follow_the_stated_policy(tmp_path):
    long = {"prompt": "p" * 10, "completion": "c" * 100}
    path = write_jsonl(tmp_path / "c.jsonl", [long, {"prompt": "q", "completion": "short"}])
    cut = record_splits(data(tmp_path, paths=(str(path),), too_long="cut"))
    assert (cut["counts"].cut, cut["counts"].examples) == (1, 2)
    lengths = sorted(len(t) for t, _ in segments(cut["train"]))
    assert lengths[-1] == 65  # cut to a row: seq_len + 1 tokens
    dropped = record_splits(data(tmp_path, paths=(str(path),), too_long="drop"))
    assert (dropped["counts"].dropped, dropped["counts"].examples) == (1, 1)
    split = record_splits(data(tmp_path, paths=(str(path),), too_long="split"))
    assert split["counts"].split == 1
    assert sum(len(t) for t, _ in segments(split["train"])) > 65


# ---- masks ------------------------------------------------------------------------------------


def test_completion_records_count_the_completion_and_its_end(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    tokens, mask = segments(record_splits(data(tmp_path, paths=(str(path),)))["train"])[0]
    tok = byte_tokenizer()
    doc = tok.eos_id
    assert tokens == (doc, *b"2+2=", *b"4", doc)
    assert mask == (0, 0, 0, 0, 0, 1, 1)
    everything = record_splits(data(tmp_path, paths=(str(path),), loss="all"))["train"]
    assert segments(everything)[0][1] == (1,) * 7


def test_chat_rows_hold_the_template_tokens_and_assistant_masks_of_transformers(tmp_path):
    """The packed rows of a run from a model directory equal what transformers'
    apply_chat_template gives for each record (ids and assistant masks), multi-turn and
    with system prompts, on a Llama-3-style template with its special tokens."""
    transformers = pytest.importorskip("transformers")
    model_dir = llama3_tokenizer_dir(tmp_path / "model", transformers)
    records = [chat(i, turns=1 + i % 3) for i in range(12)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    rows = record_splits(data(tmp_path, paths=(str(path),), tokenizer=str(model_dir),
                              seq_len=256))["train"]
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = []
    for record in records:
        out = hf.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        expected.append((tuple(out["input_ids"]), tuple(out["assistant_masks"])))
    assert segments(rows) == sorted(expected)
    assert any(sum(mask) for _, mask in expected) and all(0 in mask for _, mask in expected)


LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")


def llama3_tokenizer_dir(path: Path, transformers) -> Path:
    """A byte-level BPE trained here, with Llama 3's special tokens and a Llama-3-style chat
    template, saved as transformers saves a model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"question {i} answer {i} é" for i in range(50)], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3
    fast.save_pretrained(path)
    return path


# ---- the loss ---------------------------------------------------------------------------------


def packed_batch(tokens: np.ndarray, mask: np.ndarray) -> dict:
    segment = np.ones_like(tokens)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segment),
            "positions": jnp.asarray(positions), "loss_mask": jnp.asarray(mask, jnp.uint8)}


def test_the_loss_counts_answer_targets_alone():
    """A target is the token after its input; the last token of a row is a target and no
    input, so changing it changes that one target alone: nothing when the mask leaves it out,
    the loss and the gradient when it counts. The loss is the mean over counted targets."""
    cfg = TransformerModel(vocab=64, d_model=32, layers=1, heads=2, seq_len=16)
    model = make_transformer(cfg)
    params = model.init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 64, (2, 17))
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 64

    def loss_and_grads(tokens, mask):
        batch = packed_batch(tokens, mask)
        return jax.value_and_grad(lambda p: model.loss(p, batch, None, None)[0])(params)

    prompt_last = np.zeros((2, 17), np.uint8)
    prompt_last[:, 10:16] = 1  # the answer ends before the last token
    loss, grads = loss_and_grads(tokens, prompt_last)
    loss_changed, grads_changed = loss_and_grads(changed, prompt_last)
    assert loss == loss_changed
    jax.tree.map(np.testing.assert_array_equal, grads, grads_changed)

    answer_last = prompt_last.copy()
    answer_last[:, 16] = 1
    loss, grads = loss_and_grads(tokens, answer_last)
    loss_changed, grads_changed = loss_and_grads(changed, answer_last)
    assert loss != loss_changed
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(grads), jax.tree.leaves(grads_changed), strict=True))

    def masked_loss(positions):
        mask = np.zeros((2, 17), np.uint8)
        mask[:, positions] = 1
        return float(loss_and_grads(tokens, mask)[0])

    both = masked_loss([5, 12])
    np.testing.assert_allclose(both, (masked_loss([5]) + masked_loss([12])) / 2, rtol=1e-6)


# ---- a run's rows -----------------------------------------------------------------------------


def test_each_process_reads_its_own_rows_of_the_global_batch(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(64)])
    cfg = data(tmp_path, paths=(str(path),), batch_size=8)
    whole = build_dataset(cfg, seed=3)
    halves = [build_dataset(cfg, seed=3, process_index=p, process_count=2) for p in (0, 1)]
    for i in (0, 5, 9):  # 9: the second epoch, under its own permutation
        for name, rows in whole[i].items():
            np.testing.assert_array_equal(
                rows, np.concatenate([halves[0][i][name], halves[1][i][name]]))
            assert halves[0][i][name].shape[0] == 4


def test_a_mixture_of_record_sources_takes_rows_by_weight(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": "a" * 60} for _ in range(64)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": "b" * 60} for _ in range(64)])
    cfg = RecordsData(mix=({"source": str(first), "weight": 3}, {"source": str(second)}),
                      seq_len=64, batch_size=16, eval_fraction=0.0)
    dataset = build_dataset(cfg, seed=0)
    letters = np.concatenate([dataset[i]["tokens"][:, 1] for i in range(8)])
    assert np.count_nonzero(letters == ord("a")) == 3 * np.count_nonzero(letters == ord("b"))


def test_held_out_records_keep_their_loss_mask(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(40)])
    cfg = data(tmp_path, paths=(str(path),), eval_fraction=0.25)
    splits = record_splits(cfg)
    assert (len(segments(splits["train"])), len(segments(splits["eval"]))) == (30, 10)
    held = build_eval_dataset(cfg, batch_size=2)[0]
    assert set(held) == {"tokens", "segment_ids", "positions", "loss_mask"}
    assert 0 < held["loss_mask"].sum() < (held["segment_ids"] > 0).sum()
    files = write_jsonl(tmp_path / "held.jsonl", [chat(100 + i) for i in range(6)])
    given = record_splits(data(tmp_path, paths=(str(path),), eval_paths=(str(files),)))
    assert (len(segments(given["train"])), len(segments(given["eval"]))) == (40, 6)


def test_held_out_records_are_counted_apart_from_those_that_train(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(40)])
    counts = record_splits(data(tmp_path, paths=(str(path),), eval_fraction=0.25,
                                seq_len=256))["counts"]
    assert (counts.records, counts.examples, counts.held_records, counts.held_examples) == (
        30, 30, 10, 10)
    assert counts.summary() == "30 records -> 30 examples (10 held out)"
    metrics = counts.metrics()
    assert (metrics["records"], metrics["examples"]) == (30, 30)
    assert (metrics["held_out_records"], metrics["held_out_examples"]) == (10, 10)
    held = write_jsonl(tmp_path / "held.jsonl", [chat(100 + i) for i in range(6)])
    given = record_splits(data(tmp_path, paths=(str(path),), eval_paths=(str(held),),
                               seq_len=256))
    assert given["counts"].summary() == "40 records -> 40 examples (6 held out)"


def test_the_tokenizer_comes_from_init_from_a_model_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    from conftest import save_tiny_causal_lm

    from trainrun.checkpointing.init_from import resolved

    model_dir = save_tiny_causal_lm(tmp_path / "model", "llama", vocab_size=300)
    llama3_tokenizer_dir(model_dir, transformers)
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(8)])
    raw = {"model": {"kind": "transformer"}, "init": {"from": str(model_dir)},
           "data": {"kind": "records", "paths": [str(path)], "seq_len": 64}}
    assert resolved(config_from_dict(raw)).data.tokenizer == str(model_dir)
    raw["data"]["tokenizer"] = "bytes"
    assert resolved(config_from_dict(raw)).data.tokenizer == "bytes"  # one the run names stays


def test_a_tokenizer_larger_than_the_model_is_refused_before_the_run(tmp_path, capsys):
    from trainrun.cli import main

    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(8)])
    run_dir = tmp_path / "runs" / "small"
    code = main(["train", "--config", "chat", "--run-dir", str(run_dir), "data.synthetic=null",
                 f"data.paths={path}", "data.batch_size=4", "model.vocab=256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "has 259 tokens, more than model.vocab=256" in err[0]
    assert not run_dir.exists()


def test_kept_rows_are_read_again_and_damaged_ones_made_anew(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(20)])
    cfg = data(tmp_path, paths=(str(path),))
    first = {name: np.array(a) for name, a in record_splits(cfg)["train"].items()}
    [folder] = [p for p in (tmp_path / "cache" / "records").iterdir() if p.is_dir()]
    tokens = folder / "train.tokens.bin"
    made = tokens.stat().st_mtime_ns
    record_splits(cfg)
    assert tokens.stat().st_mtime_ns == made  # read, not made again
    tokens.write_bytes(tokens.read_bytes()[:-7])  # a cut file
    again = record_splits(cfg)
    for name, rows in first.items():
        np.testing.assert_array_equal(again["train"][name], rows)
    [notice] = again["notices"]
    assert "train.tokens.bin holds" in notice and notice.endswith("making them anew")


def test_a_file_rewritten_with_the_same_size_and_time_trains_on_its_new_records(tmp_path):
    """`cp -p` and `rsync -t` leave other records with the size and modification time of the
    old ones: the rows come from the new records, not from the kept rows of the old."""
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(10, 30)])
    cfg = data(tmp_path, paths=(str(path),))
    old = segments(record_splits(cfg)["train"])
    before = path.stat()
    new_records = [chat(i) for i in range(50, 70)]  # as many digits: the same size
    path.write_bytes(write_jsonl(tmp_path / "new.jsonl", new_records).read_bytes())  # in place
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as cp -p sets it
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    rows = segments(record_splits(cfg)["train"])
    expected = write_jsonl(tmp_path / "expected.jsonl", new_records)
    assert rows == segments(record_splits(data(tmp_path, paths=(str(expected),)))["train"])
    assert rows != old


def test_a_file_touched_but_unchanged_keeps_its_rows(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(20)])
    cfg = data(tmp_path, paths=(str(path),))
    record_splits(cfg)
    [tokens] = (tmp_path / "cache" / "records").glob("*/train.tokens.bin")
    made = tokens.stat().st_mtime_ns
    os.utime(path, ns=(made + 10**9, made + 10**9))
    record_splits(cfg)
    assert list((tmp_path / "cache" / "records").glob("*/train.tokens.bin")) == [tokens]
    assert tokens.stat().st_mtime_ns == made  # read, not made again


def test_a_byte_changed_in_kept_rows_is_found_and_the_rows_made_anew(tmp_path):
    """The kept rows carry the sha256 of each file: a token id changed in place (the size the
    same) is found when the rows are opened, and they are made again, with a notice."""
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(20)])
    cfg = data(tmp_path, paths=(str(path),))
    first = record_splits(cfg)
    assert first["notices"] == []
    rows = {name: np.array(a) for name, a in first["train"].items()}
    [folder] = [p for p in (tmp_path / "cache" / "records").iterdir() if p.is_dir()]
    tokens = folder / "train.tokens.bin"
    damaged = bytearray(tokens.read_bytes())
    damaged[100] ^= 0x01  # one token id, off by one
    tokens.write_bytes(bytes(damaged))
    again = record_splits(cfg)
    assert again["notices"] == [f"the tokenized records kept in {folder} were damaged "
                                "(train.tokens.bin does not match its sha256); making them anew"]
    for name, kept in rows.items():
        np.testing.assert_array_equal(again["train"][name], kept)
    assert record_splits(cfg)["notices"] == []  # made anew: whole again


def test_a_full_cache_directory_is_one_line_naming_it(tmp_path, monkeypatch):
    """A cache directory without room (ENOSPC as the rows are written) is one line naming the
    directory, the cause and TRAINRUN_CACHE_DIR; no half-made rows are left."""
    from trainrun.errors import WriteFailed
    from trainrun.storage import kept_files

    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(20)])

    class Full:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.file.name)

    def full_open(file, mode="r", *args, **kwargs):
        opened = open(file, mode, *args, **kwargs)  # noqa: SIM115 (closed by the caller)
        return Full(opened) if str(file).endswith(".bin") else opened

    monkeypatch.setattr(kept_files, "open", full_open, raising=False)
    with pytest.raises(WriteFailed) as err:
        record_splits(data(tmp_path, paths=(str(path),)))
    root = tmp_path / "cache" / "records"
    assert str(err.value) == (f"cannot keep the tokenized records in {root}: no space left on "
                              "device; free space there, or set TRAINRUN_CACHE_DIR to a "
                              "directory with room")
    assert err.value.__context__ is None  # nothing below it for a report to name instead
    assert [p for p in root.iterdir() if p.is_dir()] == []


@pytest.mark.slow
def test_a_run_says_when_it_makes_damaged_rows_anew(tmp_path, cli):
    from trainrun.cli import main

    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(16)])
    argv = ["train", "--config", "chat", "data.synthetic=null", f"data.paths={path}", "steps=1",
            "steps_per_call=1", "eval.every=0", "checkpoint.every=0", "data.batch_size=2",
            "optimizer.schedule.kind=constant", "model.d_model=16", "model.layers=1",
            "model.heads=2", "metrics.tensorboard=false"]
    assert main([*argv, "--run-dir", str(tmp_path / "first")]) == 0
    [tokens] = (tmp_path / "cache" / "records").glob("*/train.tokens.bin")
    tokens.write_bytes(tokens.read_bytes()[:-1] + b"\xff")
    again = cli(*argv, "--run-dir", str(tmp_path / "second"),
                TRAINRUN_CACHE_DIR=str(tmp_path / "cache"))  # a process of its own reads them
    assert again.returncode == 0, again.stderr[-3000:]
    notices = [line for line in again.stdout.splitlines() if "were damaged" in line]
    assert notices == [f"the tokenized records kept in {tokens.parent} were damaged "
                       "(train.tokens.bin does not match its sha256); making them anew"], \
        again.stdout
