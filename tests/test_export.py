"""``trainrun export --to``: a new or empty directory is written, anything else is refused on one
line with nothing changed; ``--replace`` leaves exactly the new export, and a failure midway
leaves the old directory as it was."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from trainrun import export
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.training.loop import run

pytest.importorskip("safetensors", reason="the tests' extra holds safetensors")

FILES = ["config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A 2-step byte-level LM in GPT-2's layout."""
    tmp_path = tmp_path_factory.mktemp("export")
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup_steps=1", "metrics.tensorboard=false", "model.d_model=32",
        "model.layers=2", "model.heads=2", "model.seq_len=32", "model.positions=learned",
        "model.bias=true", f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=4"])
    run(config, tmp_path / "run", out=io.StringIO())
    return tmp_path / "run"


def listing(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


def export_cli(capfd, *args: str) -> tuple[int, str]:
    code = main(["export", *args])
    captured = capfd.readouterr()
    return code, captured.err


def stale_model_dir(path: Path) -> Path:
    """A model directory from an earlier export, with a file this export does not write."""
    path.mkdir()
    (path / "config.json").write_text('{"old": true}\n')
    (path / "model.safetensors").write_bytes(b"old weights")
    (path / "generation_config.json").write_text('{"old": true}\n')
    return path


# A --to that is refused is refused before the run is read: these need no trained run.
NO_RUN = "runs/never-read"


def test_export_to_an_existing_file_is_refused_and_leaves_it(tmp_path, capfd):
    target = tmp_path / "model"
    target.write_text("mine\n")
    code, err = export_cli(capfd, NO_RUN, "--to", str(target))
    assert code == 2 and err.count("\n") == 1 and "is a file, not a directory" in err, err
    assert target.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_to_a_non_empty_directory_is_refused_and_names_replace(tmp_path, capfd):
    target = stale_model_dir(tmp_path / "model")
    before = listing(target)
    code, err = export_cli(capfd, NO_RUN, "--to", str(target))
    assert code == 2 and err.count("\n") == 1, err
    assert f"--to {target} is not empty" in err and "--replace" in err
    assert listing(target) == before

    user = tmp_path / "notes"  # --replace deletes only a model directory
    user.mkdir()
    (user / "todo.txt").write_text("mine\n")
    code, err = export_cli(capfd, NO_RUN, "--to", str(user), "--replace")
    assert code == 2 and err.count("\n") == 1 and "not a model directory" in err, err
    assert listing(user) == {"todo.txt": b"mine\n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes"]


@pytest.mark.slow
def test_export_to_a_new_or_empty_directory_writes_it(lm_run, tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (empty, tmp_path / "new" / "model"):
        code, _ = export_cli(capfd, str(lm_run), "--to", str(target))
        assert code == 0 and sorted(p.name for p in target.iterdir()) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]  # no staging left


@pytest.mark.slow
def test_replace_leaves_exactly_the_new_export(lm_run, tmp_path, capfd):
    fresh = tmp_path / "fresh"
    assert export_cli(capfd, str(lm_run), "--to", str(fresh))[0] == 0
    target = stale_model_dir(tmp_path / "model")
    code, err = export_cli(capfd, str(lm_run), "--to", str(target), "--replace")
    assert code == 0, err
    assert listing(target) == listing(fresh)  # nothing stale: no generation_config.json
    assert json.loads((target / "config.json").read_text())["n_embd"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "model"]


@pytest.mark.slow
def test_a_failure_midway_leaves_the_old_directory(lm_run, tmp_path, monkeypatch):
    target = stale_model_dir(tmp_path / "model")
    before = listing(target)

    def full_disk(params, cfg, path: Path, **_) -> Path:
        (path / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device", str(path / "model.safetensors"))

    monkeypatch.setattr(export, "write_model_dir", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export.export_run(lm_run, target, replace=True)
    assert listing(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left


@pytest.mark.slow
def test_a_tokenized_run_exports_its_tokenizer_and_token_ids(tmp_path, capfd):
    """Before, the export of a run trained with a tokenizer had neither the tokenizer nor its
    bos/eos ids (null), so transformers could not stop or start a document."""
    tokenizers = pytest.importorskip("tokenizers")
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm_bpe", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup_steps=1", "metrics.tensorboard=false", "model.d_model=32",
        "model.layers=1", "model.heads=2", "model.seq_len=32", "model.positions=learned",
        "model.bias=true", "model.vocab=300", f"data.paths=[{corpus}]", "data.seq_len=32",
        "data.batch_size=4", f"data.tokenizer={tmp_path / 'tok.json'}", "data.vocab_size=300"])
    run(config, tmp_path / "run", out=io.StringIO())
    code, err = export_cli(capfd, str(tmp_path / "run"), "--to", str(tmp_path / "out"))
    assert code == 0, err
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    document = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(
        "<|endoftext|>")
    hf = json.loads((out / "config.json").read_text())
    assert hf["bos_token_id"] == hf["eos_token_id"] == document is not None
