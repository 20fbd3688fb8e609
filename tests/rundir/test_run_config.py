"""``trainrun train --run-dir DIR steps=N`` without ``--config`` resumes or extends DIR with its
own saved config, whatever config made it; ``config show --run-dir DIR`` shows that config."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from trainrun import rundir
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.rundir.run_config import command_config
from trainrun.training.loop import run

LM = ["steps=2", "steps_per_call=1", "checkpoint.every=2", "eval.every=0",
      "optimizer.schedule.warmup=1", "metrics.tensorboard=false", "model.d_model=32",
      "model.layers=1", "model.heads=2", "model.seq_len=32", "data.seq_len=32",
      "data.batch_size=4"]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A 2-step byte LM from the built-in lm config: nothing of it is mlp's."""
    tmp_path = tmp_path_factory.mktemp("resume")
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    run(load_config("lm", [*LM, f"data.paths=[{corpus}]"]), tmp_path / "run",
        out=io.StringIO())
    return tmp_path / "run"


def test_without_config_a_run_directory_gives_its_own_config(lm_run):
    resolved = command_config(None, ["steps=4"], lm_run)
    saved = load_config(str(lm_run / rundir.CONFIG))
    assert resolved.saved == lm_run / rundir.CONFIG and resolved.run_dir == lm_run
    assert resolved.config.model == saved.model and resolved.config.data == saved.data
    assert resolved.config.steps == 4  # the override over the saved config


def test_the_saved_config_leaves_out_how_its_job_joined_its_processes(lm_run, tmp_path):
    """A run written by `launch -n 2` saved its process id and coordinator: resumed on one
    process from that config, it waited for a coordinator that was gone."""
    import shutil

    import yaml

    copy = tmp_path / "run"
    shutil.copytree(lm_run, copy)
    saved = yaml.safe_load((copy / rundir.CONFIG).read_text())
    saved["distributed"] = {"kind": "explicit", "coordinator": "127.0.0.1:1234",
                            "num_processes": 2, "process_id": 1}
    (copy / rundir.CONFIG).write_text(yaml.safe_dump(saved))
    assert command_config(None, [], copy).config.distributed.kind == "none"
    assert command_config(None, ["distributed.kind=auto"], copy).config.distributed.kind == \
        "auto"


def test_a_config_named_or_a_folder_without_a_run_keeps_the_named_or_default(lm_run, tmp_path):
    assert command_config("lm", [], lm_run).saved is None  # --config wins
    for folder in (tmp_path / "new", tmp_path):  # absent; a folder that is not a run
        resolved = command_config(None, [], folder)
        assert resolved.saved is None and resolved.config.model.kind == "mlp"
    mine = tmp_path / "mine"  # a user's config.yaml in a folder that is not trainrun's
    mine.mkdir()
    (mine / "config.yaml").write_text("model: {kind: transformer}\n")
    assert command_config(None, [], mine).saved is None


@pytest.mark.slow
def test_train_with_the_run_directory_alone_extends_an_lm_run(lm_run, tmp_path, capfd):
    """Before, the default mlp config was the base: the lm run was refused as 'trained with a
    different config (data.batch_size: 4 -> 256; ... model.kind: 'transformer' -> 'mlp' ...)'."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(lm_run, copy)
    code = main(["train", "--run-dir", str(copy), "steps=3"])
    assert code == 0, capfd.readouterr().err
    summary = json.loads((copy / rundir.SUMMARY).read_text())
    assert summary["start_step"] == 2 and summary["steps_done"] == 3


def test_config_show_with_a_run_directory_shows_its_config_and_the_overrides(lm_run, capfd):
    assert main(["config", "show", "--run-dir", str(lm_run), "steps=9"]) == 0
    shown = capfd.readouterr().out
    assert "kind: transformer" in shown and f"# run: {lm_run}" in shown
    assert any(line.startswith("steps: 9") and line.endswith("# override")
               for line in shown.splitlines())


def test_a_changed_config_names_a_few_keys_and_the_way_to_resume(lm_run, capfd):
    """A whole other config was one 3,000-character line naming 50 keys."""
    code = main(["train", "--config", "mlp", "--run-dir", str(lm_run), "steps=5"])
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "and " in err and "more" in err and "Leave out --config" in err
    assert len(err) < 1200
