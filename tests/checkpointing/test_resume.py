"""Resume, proved: ``trainrun verify-resume`` kills real processes (SIGKILL) at checkpoints, one
of them while an asynchronous save is in flight, and passes only when every step's loss and
the final state are bitwise equal to an uninterrupted run; a planted fault makes it fail. A
checkpoint written on 4 devices resumes on 2 and on 1. A resume on data files other than
those the run trained on is refused, unless asked for; the same files, touched, resume
bitwise."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import losses

from trainrun import data, rundir
from trainrun.checkpointing.resume import DataChangedError
from trainrun.cli import main as cli_main
from trainrun.config import load_config
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run

# A model that draws from the step key (dropout) on a shuffled iterator (batch < examples):
# resume is only right if the key, the step and the data position all come back.
DROPOUT = """\
name: dropout
seed: 3
steps: 30
model: {kind: nnx_mlp, features: 8, hidden: [16], dropout: 0.25}
data: {kind: regression, examples: 96, batch_size: 16, shuffle: true}
optimizer: {name: adam, lr: 0.01}
checkpoint: {every: 10}
metrics: {every: 10, tensorboard: false}
"""


def verify(cli, tmp_path, *args, **env):
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), *args, **env)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def table_row(stdout: str, label: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(label))


@pytest.mark.slow
def test_default_mlp_resumes_bitwise_at_both_kill_points(cli, tmp_path):
    result = verify(cli, tmp_path, "steps=60", "checkpoint.every=20", "metrics.tensorboard=false")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "PASS" in result.stdout
    committed = table_row(result.stdout, "kill -9 after checkpoint 20 committed")
    in_save = table_row(result.stdout, "kill -9 during async save of 40")
    assert committed.split()[-4:] == ["20", "60", "none", "equal"]
    assert "in flight" in in_save  # the kill landed before the save of step 40 committed
    assert in_save.split()[-4:] == ["20", "60", "none", "equal"]  # so it resumed from 20
    assert not (tmp_path / "verify").exists()  # a passing check cleans up after itself


@pytest.mark.slow
def test_dropout_and_shuffled_data_resume_bitwise(cli, tmp_path):
    config = tmp_path / "dropout.yaml"
    config.write_text(DROPOUT)
    result = verify(cli, tmp_path, "--config", str(config), "--keep")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "in flight" in table_row(result.stdout, "kill -9 during async save of 20")
    position = tmp_path / "verify" / "uninterrupted" / "checkpoints" / "30" / "data"
    assert json.loads((position / "process_0-of-1.json").read_text()) == {"next_index": 30}


@pytest.mark.slow
def test_k_step_calls_with_batches_made_ahead_resume_bitwise(cli, tmp_path):
    # K = 100 on shuffled data: each call's batches gathered at once (calls of 50, cut at the
    # checkpoints); the position a checkpoint saves must be that of the steps done.
    result = verify(cli, tmp_path, "steps=300", "steps_per_call=100", "checkpoint.every=50",
                    "data.shuffle=true", "data.batch_size=64", "metrics.tensorboard=false")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "in flight" in table_row(result.stdout, "kill -9 during async save of 100")
    assert table_row(result.stdout, "kill -9 after checkpoint 50 committed").split()[-4:] == [
        "50", "300", "none", "equal"]


PLANT = """\
# Planted fault: checkpoints record the data position as 0, so a resumed run re-reads the
# shuffled data from its first batch.
from trainrun.checkpointing import checkpoints as checkpoint

def save(self, directory, item=None, args=None):
    (directory / checkpoint._process_file()).write_text('{"next_index": 0}')

checkpoint.DataHandler.save = save
"""


@pytest.mark.slow
def test_a_planted_fault_makes_verify_resume_fail(cli, tmp_path):
    config = tmp_path / "dropout.yaml"
    config.write_text(DROPOUT)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(PLANT))
    result = verify(cli, tmp_path, "--config", str(config), "--kill-at", "10",
                    PYTHONPATH=str(site))
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    row = table_row(result.stdout, "kill -9 after checkpoint 10 committed")
    assert "step 11: loss" in row and row.split()[-1] == "differs"
    assert "FAIL" in result.stdout and "runs kept in" in result.stdout


def test_bad_kill_point_or_used_work_dir_is_a_one_line_error(tmp_path, capsys):
    assert cli_main(["verify-resume", "steps=60", "checkpoint.every=20", "--kill-at", "30"]) == 2
    assert capsys.readouterr().err == (
        "error: step 30 is not a checkpoint before the end (checkpoint.every=20, steps=60); "
        "kill at one of 20, 40\n")
    (tmp_path / "old").mkdir()
    assert cli_main(["verify-resume", "--work-dir", str(tmp_path)]) == 2
    assert "is not empty; its runs would be resumed" in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoint_from_4_devices_resumes_on_2_and_on_1(cli, tmp_path):
    """Restore places the state by the new run's mesh (explicit target shardings)."""
    common = ["steps=20", "checkpoint.every=10", "metrics.every=10", "metrics.tensorboard=false",
              "data.batch_size=64"]
    four = tmp_path / "four"
    reference = cli("train", "--run-dir", str(four), *common, devices=4)
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = np.array([r["loss"] for r in read_metrics(four / "metrics.jsonl")])
    for devices in (2, 1):
        run_dir = tmp_path / f"on{devices}"
        shutil.copytree(four, run_dir)
        shutil.rmtree(run_dir / "checkpoints" / "20")  # in the copy: step 10 is the latest
        resumed = cli("train", "--run-dir", str(run_dir), *common, devices=devices)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "resumed from step 10" in resumed.stdout
        assert f"device_count 4 -> {devices}" in resumed.stdout  # bits not promised: warned
        got = np.array([r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")])
        assert len(got) == 20
        np.testing.assert_allclose(got, expected, rtol=1e-5)


# ---- the data a run reads --------------------------------------------------------------------

# The chat config on record files, shrunk to a few quick steps; a checkpoint every 2.
RECORDS = ["data.synthetic=null", "steps_per_call=1", "eval.every=0", "checkpoint.every=2",
           "data.batch_size=2", "optimizer.schedule.kind=constant", "model.d_model=16",
           "model.layers=1", "model.heads=2", "metrics.every=1", "metrics.tensorboard=false"]


def write_chat(path: Path, answer: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": f"{answer} {i}"}]}) + "\n" for i in range(24)))
    return path


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """The test's folder as the working directory, with its own record cache; the data a
    process loaded is forgotten, as a new process would read the files again."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    data._load.cache_clear()
    yield tmp_path
    data._load.cache_clear()


@pytest.mark.slow
def test_a_resume_on_rewritten_records_is_refused_naming_the_file(in_tmp, capfd):
    records = write_chat(in_tmp / "data" / "edit2.jsonl", "answer")
    argv = ["train", "--config", "chat", *RECORDS, "data.paths=[data/edit2.jsonl]",
            "--run-dir", "c07b"]
    assert cli_main([*argv, "steps=2"]) == 0
    recorded = rundir.read_json(in_tmp / "c07b" / rundir.DATA_FILES)
    assert recorded == {"files": {"data/edit2.jsonl": sha256(records)}}

    write_chat(records, "reply")  # every answer rewritten
    data._load.cache_clear()
    before = listing(in_tmp / "c07b")
    capfd.readouterr()
    assert cli_main([*argv, "steps=4"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: c07b was trained on other data "
                                                   "(data/edit2.jsonl changed)"), err
    assert "--allow-data-change" in err
    assert listing(in_tmp / "c07b") == before  # refused before anything was written

    assert cli_main([*argv, "steps=4", "--allow-data-change"]) == 0
    assert [r["step"] for r in read_metrics(in_tmp / "c07b" / rundir.METRICS)] == [1, 2, 3, 4]
    assert rundir.read_json(in_tmp / "c07b" / rundir.DATA_FILES) == {
        "files": {"data/edit2.jsonl": sha256(records)}}  # what it trains on from now on


@pytest.mark.slow
def test_records_touched_but_unchanged_resume_bitwise_and_appended_are_refused(in_tmp):
    records = write_chat(in_tmp / "chat.jsonl", "answer")

    def train(run_dir: str, steps: int, **allow: bool) -> str:
        out = io.StringIO()
        config = load_config("chat", [*RECORDS, f"data.paths=[{records}]", f"steps={steps}"])
        run(config, run_dir, out=out, **allow)
        data._load.cache_clear()
        return out.getvalue()

    train("whole", 4)
    train("split", 2)
    later = records.stat().st_mtime + 100
    os.utime(records, (later, later))  # a new time, the same bytes
    out = train("split", 4)
    assert "resumed from step 2" in out and "warning" not in out
    assert losses(in_tmp / "split").tobytes() == losses(in_tmp / "whole").tobytes()

    # a run directory from before the record: nothing to compare, recorded from now on
    (in_tmp / "split" / rundir.DATA_FILES).unlink()
    out = train("split", 6)
    assert "resumed from step 4" in out and "warning" not in out
    assert rundir.read_json(in_tmp / "split" / rundir.DATA_FILES) == {
        "files": {str(records): sha256(records)}}

    with records.open("a") as more:  # appended to
        more.write(json.dumps({"messages": [{"role": "user", "content": "one more"},
                                            {"role": "assistant", "content": "yes"}]}) + "\n")
    with pytest.raises(DataChangedError, match=f"{records} changed"):
        train("split", 8)
    out = train("split", 8, allow_data_change=True)
    assert (f"warning: resuming on changed data (--allow-data-change): {records} changed"
            in out) and "resumed from step 6" in out


def test_data_changes_name_each_file_changed_new_or_gone(tmp_path):
    from trainrun.checkpointing.resume import check_data

    saved = {"a.jsonl": "sha256:1", "b.jsonl": "sha256:2", "c.jsonl": "sha256:3"}
    now = {"a.jsonl": "sha256:1", "b.jsonl": "sha256:9", "d.jsonl": "sha256:4"}
    with pytest.raises(DataChangedError) as err:
        check_data(saved, now, False, tmp_path / "run")
    assert str(err.value).startswith(
        f"{tmp_path / 'run'} was trained on other data (b.jsonl changed; c.jsonl is no longer "
        "read; d.jsonl is read now and was not); ")
    assert check_data(saved, now, True, tmp_path) == [
        "b.jsonl changed", "c.jsonl is no longer read", "d.jsonl is read now and was not"]
    assert check_data(None, now, False, tmp_path) == []  # a run that recorded none
    assert check_data(saved, dict(saved), False, tmp_path) == []


def test_a_key_added_since_the_checkpoint_resumes_at_its_default(tmp_path):
    """A run saved before ``model.fused_projections`` existed resumes: the key it lacks takes
    its default, which computes what the run computed. The same key at another value than the
    default is still a change."""
    from trainrun.checkpointing.resume import ConfigChangedError, check_config

    config = load_config("lm", ["steps=4"])
    saved = config.to_dict()
    del saved["model"]["fused_projections"]
    assert check_config(saved, config, False, tmp_path) == []
    fused = config.model_copy(update={"model": config.model.model_copy(
        update={"fused_projections": True})})
    with pytest.raises(ConfigChangedError, match=r"model\.fused_projections: False -> True"):
        check_config(saved, fused, False, tmp_path)
