"""Resume, proved: ``trainrun verify-resume`` kills real processes (SIGKILL) at checkpoints, one
of them while an asynchronous save is in flight, and passes only when every step's loss and
the final state are bitwise equal to an uninterrupted run; a planted fault makes it fail. A
checkpoint written on 4 devices resumes on 2 and on 1."""

from __future__ import annotations

import json
import shutil
import textwrap

import numpy as np
import pytest

from trainrun.cli import main as cli_main
from trainrun.reporting.sinks.jsonl import read_metrics

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
