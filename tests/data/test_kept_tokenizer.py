"""A run keeps the tokenizer it reads text with (``tokenizer/`` in its run directory): sampling,
``trainrun.load_tokenizer``, ``trainrun eval``, export and a fine-tune from the run read that
copy, so a run whose ``data.tokenizer`` was replaced or removed afterwards still speaks the
token ids it trained on, and a resume on another tokenizer is refused in one line before
anything is written."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import pytest

import trainrun
from trainrun import rundir
from trainrun.checkpointing.resume import DataChangedError
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.data import model_tokenizer
from trainrun.data.chat import CHATML
from trainrun.data.kept_tokenizer import FOLDER, run_records_tokenizer
from trainrun.evaluation.evaluate import evaluate_run
from trainrun.evaluation.sample import chat_answers, sample_run
from trainrun.export import export_run
from trainrun.storage import location
from trainrun.training.loop import run

CORPUS = {"a.py": "def add(a, b):\n    return a + b\n" * 30,
          "b.py": "import os\nprint(os.getcwd(), 'café')\n" * 40,
          "c.py": "class A:\n    x = 1\n" * 25}


REFUSED = re.escape("(data.tokenizer is not the one it trained with, kept in tokenizer/)")


def other_tokenizer_json() -> str:
    """A tokenizer.json of other ids than the one trained on CORPUS: one token per byte."""
    return model_tokenizer.byte_tokenizer().tokenizer.to_str()


def text_run_on_corpus(folder: Path) -> tuple[Path, list[str]]:
    """CORPUS written into ``folder``; the tokenizer.json a small tokenized text run on it
    trains (at first use) and reads, and that run's overrides (without its steps)."""
    for name, text in CORPUS.items():
        (folder / name).write_text(text)
    tok = folder / "tok.json"
    return tok, [f"data.paths=[{folder}/*.py]", f"data.tokenizer={tok}", "data.vocab_size=300",
                 "model.vocab=300", "data.seq_len=16", "model.seq_len=16", "model.d_model=16",
                 "model.layers=1", "model.norm=rmsnorm", "model.mlp=swiglu",
                 "data.batch_size=4", "eval.every=0", "steps_per_call=3",
                 "metrics.tensorboard=false", "checkpoint.every=6", "checkpoint.async=false"]


def write_model_tokenizer(folder: Path, chat_template: str) -> None:
    """A model directory's tokenizer files in ``folder``: the byte tokenizer, its special
    tokens and ``chat_template``, and its stop id."""
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(model_tokenizer.byte_tokenizer().tokenizer.to_str())
    settings = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                "chat_template": chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257]}))


def chat_run_overrides(model_dir: Path) -> list[str]:
    """A small chat run's overrides (without its steps), reading records with ``model_dir``'s
    tokenizer and chat template."""
    return [f"data.tokenizer={model_dir}", "data.chat_template=null", "model.d_model=32",
            "model.layers=1", "data.synthetic_examples=256", "data.batch_size=8",
            "eval.every=0", "steps_per_call=2", "checkpoint.every=4", "checkpoint.async=false",
            "metrics.tensorboard=false", "optimizer.schedule.warmup=1"]


OTHER_CHATML = CHATML.replace("<|im_start|>", "<|im_start|> ")  # another template, same ids


@pytest.mark.slow
def test_a_text_run_samples_through_its_kept_tokenizer_and_refuses_another_on_resume(tmp_path):
    tok, small = text_run_on_corpus(tmp_path)
    run_dir = tmp_path / "run"
    run(load_config("lm_bpe", [*small, "steps=6"]), run_dir, out=io.StringIO())
    trained_with = tok.read_bytes()  # trained and written at first use
    assert (run_dir / FOLDER / "tokenizer.json").read_bytes() == trained_with
    before = sample_run(run_dir, "def add", 8, temperature=0)
    ids = trainrun.load_tokenizer(run_dir).encode("def add(a, b)")

    tok.write_text(other_tokenizer_json())  # data.tokenizer now names another tokenizer
    assert sample_run(run_dir, "def add", 8, temperature=0) == before
    assert trainrun.load_tokenizer(run_dir).encode("def add(a, b)") == ids
    metrics = (run_dir / rundir.METRICS).read_bytes()
    with pytest.raises(DataChangedError, match=REFUSED):
        run(load_config("lm_bpe", [*small, "steps=9"]), run_dir, out=io.StringIO())
    assert (run_dir / FOLDER / "tokenizer.json").read_bytes() == trained_with
    assert (run_dir / rundir.METRICS).read_bytes() == metrics

    moved = tmp_path / "moved"  # the run elsewhere, its data.tokenizer gone
    shutil.copytree(run_dir, moved)
    tok.unlink()
    assert sample_run(moved, "def add", 8, temperature=0) == before
    export_run(moved, tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == trained_with


@pytest.mark.slow
def test_a_chat_run_answers_through_its_kept_tokenizer_and_template(tmp_path):
    model_dir = tmp_path / "model-tokenizer"
    write_model_tokenizer(model_dir, CHATML)
    overrides = chat_run_overrides(model_dir)
    run_dir = tmp_path / "run"
    config = load_config("chat", [*overrides, "steps=4"])
    run(config, run_dir, out=io.StringIO())
    named, kept = model_tokenizer.load(str(model_dir)), run_records_tokenizer(
        location.local(run_dir), config.data)
    assert kept.tokenizer.to_str() == named.tokenizer.to_str()
    assert (kept.special, kept.eos_id, kept.stop_ids) == (named.special, named.eos_id,
                                                          named.stop_ids)
    assert kept.template is not None and named.template is not None
    assert kept.template.source == named.template.source
    before = chat_answers(run_dir, ["abc", "hello"], 12)
    scored = evaluate_run(run_dir, tokens=8, limit=2)

    write_model_tokenizer(model_dir, OTHER_CHATML)
    assert chat_answers(run_dir, ["abc", "hello"], 12) == before
    assert evaluate_run(run_dir, tokens=8, limit=2) == scored  # the held-out records alike
    with pytest.raises(DataChangedError, match=REFUSED):
        run(load_config("chat", [*overrides, "steps=6"]), run_dir, out=io.StringIO())
    shutil.rmtree(model_dir)
    assert chat_answers(run_dir, ["abc", "hello"], 12) == before
    export_run(run_dir, tmp_path / "export")  # no source model: the kept tokenizer goes with it
    assert chat_answers(tmp_path / "export", ["abc", "hello"], 12) == before
    # A fine-tune from the run that names no tokenizer takes the one the run keeps.
    tuned = tmp_path / "tuned"
    run(load_config("chat", [*overrides[1:], "data.tokenizer=null", f"init.from={run_dir}",
                             "steps=2"]), tuned, out=io.StringIO())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tuned / FOLDER / name).read_bytes() == (run_dir / FOLDER / name).read_bytes()
    # its config names the kept folder wherever it is read from, as the source's is gone
    saved = load_config(str(tuned / rundir.CONFIG)).data
    assert saved.tokenizer == str((run_dir / FOLDER).absolute())  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_kept_tokenizer_folder_that_is_a_link_is_refused_and_its_target_left_alone(
        tmp_path, capsys):
    """The folder a run keeps its tokenizer in, made a link to a user's folder: the resume,
    a sample, an eval and an export are each refused in one line (exit 2), nothing is
    written through it; so is a link in place of one of its files."""
    run_dir = tmp_path / "run"
    small = ["--run-dir", str(run_dir), "model.d_model=32", "model.layers=1",
             "data.synthetic_examples=256", "data.batch_size=8", "eval.every=0",
             "steps_per_call=2", "checkpoint.every=2", "metrics.tensorboard=false"]
    assert main(["train", "--config", "chat", *small, "steps=2"]) == 0
    assert (run_dir / FOLDER / "tokenizer.json").is_file()
    users = tmp_path / "my-tokenizer"
    users.mkdir()
    (users / "tokenizer.json").write_text("mine\n")
    kept = tmp_path / "kept"
    shutil.copytree(run_dir / FOLDER, kept)
    shutil.rmtree(run_dir / FOLDER)
    (run_dir / FOLDER).symlink_to(users)
    capsys.readouterr()
    assert main(["train", "--config", "chat", *small, "steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run_dir / FOLDER} is a symbolic link" in err, err
    readers = [["sample", str(run_dir), "--prompt", "hi", "--tokens", "2"],
               ["eval", str(run_dir), "--tokens", "2", "--limit", "2"],
               ["export", str(run_dir), "--to", str(tmp_path / "export")]]
    for command in readers:
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run_dir / FOLDER} is a symbolic link" in err, err
    assert not (tmp_path / "export").exists()
    assert [p.name for p in users.iterdir()] == ["tokenizer.json"]
    assert (users / "tokenizer.json").read_text() == "mine\n"

    (run_dir / FOLDER).unlink()  # the run's own folder back, one file of it a link
    shutil.copytree(kept, run_dir / FOLDER)
    (run_dir / FOLDER / "tokenizer_config.json").unlink()
    (run_dir / FOLDER / "tokenizer_config.json").symlink_to(users / "tokenizer.json")
    assert main(readers[0]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir / FOLDER / 'tokenizer_config.json'} is a symbolic link" in err, err


@pytest.mark.slow
def test_a_text_run_on_a_bucket_samples_and_exports_through_its_kept_tokenizer(
        tmp_path, object_store_servers):
    from conftest import upload_run

    tok, small = text_run_on_corpus(tmp_path)
    run_dir = tmp_path / "run"
    run(load_config("lm_bpe", [*small, "steps=6"]), run_dir, out=io.StringIO())
    trained_with = tok.read_bytes()
    before = sample_run(run_dir, "def add", 8, temperature=0)
    url = object_store_servers["s3"].new_bucket() + "/runs/text"
    upload_run(run_dir, url)
    tok.write_text(other_tokenizer_json())  # data.tokenizer now names another tokenizer

    assert sample_run(url, "def add", 8, temperature=0) == before
    export_run(url, tmp_path / "export")
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == trained_with


@pytest.mark.slow
def test_a_chat_run_on_a_bucket_answers_scores_and_exports_through_its_kept_tokenizer(
        tmp_path, object_store_servers):
    from conftest import upload_run

    model_dir = tmp_path / "model-tokenizer"
    write_model_tokenizer(model_dir, CHATML)
    run_dir = tmp_path / "run"
    run(load_config("chat", [*chat_run_overrides(model_dir), "steps=4"]), run_dir,
        out=io.StringIO())
    before = chat_answers(run_dir, ["abc", "hello"], 12)
    scored = evaluate_run(run_dir, tokens=8, limit=2)
    url = object_store_servers["gs"].new_bucket() + "/runs/chat"
    upload_run(run_dir, url)
    write_model_tokenizer(model_dir, OTHER_CHATML)

    assert chat_answers(url, ["abc", "hello"], 12) == before
    assert evaluate_run(url, tokens=8, limit=2) == scored
    export_run(url, tmp_path / "export")  # no source model: the kept tokenizer goes with it
    assert chat_answers(tmp_path / "export", ["abc", "hello"], 12) == before
