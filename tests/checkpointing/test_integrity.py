"""Checkpoint checksums: written with every item of a step, verified before a step is read; a
changed byte makes the step unreadable, and the run resumes from the one before, bit for bit."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import losses

from trainrun.checkpointing import integrity
from trainrun.cli import main as cli_main
from trainrun.config import load_config
from trainrun.training.loop import run

SMALL = ["steps=30", "checkpoint.every=10", "metrics.every=10", "metrics.tensorboard=false"]


def train(run_dir: Path, *overrides: str) -> str:
    out = io.StringIO()
    run(load_config("mlp", [*SMALL, *overrides]), run_dir, out=out)
    return out.getvalue()


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> np.ndarray:
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    train(run_dir, "steps=40")
    return losses(run_dir)


def flip_array_bytes(step_dir: Path) -> Path:
    """Four bytes inverted in place in the middle of the largest array data file."""
    files = list((step_dir / "state" / "ocdbt.process_0" / "d").iterdir())
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4] = bytes(b ^ 0xFF for b in data[middle:middle + 4])
    target.write_bytes(bytes(data))  # same size: only a checksum can tell
    return target


# A failed read leaves TensorStore callbacks for Orbax's closed asyncio loop (unraisable).
tolerate_failed_reads = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.mark.slow
@tolerate_failed_reads
def test_flipped_bytes_in_an_array_file_fall_back_to_the_previous_step(tmp_path, whole):
    run_dir = tmp_path / "run"
    train(run_dir)
    flipped = flip_array_bytes(run_dir / "checkpoints" / "30")
    out = train(run_dir, "steps=40")
    name = flipped.relative_to(run_dir / "checkpoints" / "30")
    assert f"warning: checkpoint step 30 cannot be read (checksum mismatch in {name}" in out
    assert "resumed from step 20" in out
    assert [p.name.split("-")[0] for p in (run_dir / "checkpoints" / "corrupt").iterdir()] == [
        "30"]  # moved aside, not deleted
    assert losses(run_dir).tobytes() == whole.tobytes()  # 21..40 redone from the good state


def test_every_item_has_checksums_and_verify_checkpoint_reads_them(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(run_dir)
    step_dir = run_dir / "checkpoints" / "30"
    for item in integrity.ITEMS:
        listed = json.loads((step_dir / item / integrity.MANIFEST).read_text())["files"]
        assert listed and all(len(f["sha256"]) == 64 for f in listed.values())
    assert cli_main(["verify-checkpoint", str(run_dir)]) == 0
    assert "30: " in capsys.readouterr().out

    position = step_dir / "data" / "process_0-of-1.json"
    position.write_text(position.read_text().replace("30", "31"))  # the data position
    assert cli_main(["verify-checkpoint", str(run_dir), "30"]) == 1
    assert "checksum mismatch in data/process_0-of-1.json" in capsys.readouterr().out
    assert cli_main(["verify-checkpoint", str(run_dir), "20"]) == 0
    assert cli_main(["verify-checkpoint", str(run_dir), "25"]) == 2
    assert "no checkpoint of step 25; its steps: 10, 20, 30" in capsys.readouterr().err


def test_a_damaged_step_record_is_reported_and_a_resume_rewrites_it(tmp_path, capsys, whole):
    """Before, verify-checkpoint passed a step whose _CHECKPOINT_METADATA held random bytes,
    and a resume stopped on a traceback where it held a JSON object Orbax does not take."""
    run_dir = tmp_path / "run"
    train(run_dir)
    steps = run_dir / "checkpoints"
    (steps / "30" / integrity.STEP_RECORD).write_bytes(b"\x93garbage{\x00")
    (steps / "20" / integrity.STEP_RECORD).write_text('{"item_handlers": 5}')
    capsys.readouterr()
    assert cli_main(["verify-checkpoint", str(run_dir)]) == 1
    assert capsys.readouterr().out.startswith(
        f"{steps / '30'}: _CHECKPOINT_METADATA, Orbax's record of step 30, is not JSON")
    assert cli_main(["verify-checkpoint", str(run_dir), "20"]) == 1
    assert capsys.readouterr().out.startswith(
        f"{steps / '20'}: _CHECKPOINT_METADATA, Orbax's record of step 20, is not one Orbax "
        "reads")
    assert cli_main(["verify-checkpoint", str(run_dir), "10"]) == 0

    out = train(run_dir, "steps=40")  # the record is Orbax's: rewritten, the step's files kept
    assert "rewrote step 20's _CHECKPOINT_METADATA" in out
    assert "rewrote step 30's _CHECKPOINT_METADATA" in out
    assert "resumed from step 30" in out
    assert losses(run_dir).tobytes() == whole.tobytes()
    for step in ("20", "30", "40"):
        assert cli_main(["verify-checkpoint", str(run_dir), step]) == 0


def test_missing_or_extra_files_and_a_step_without_checksums(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir)
    step_dir = run_dir / "checkpoints" / "30"
    assert integrity.verify_step(step_dir).problems == []
    (step_dir / "state" / "planted").write_bytes(b"x")
    (step_dir / "meta" / "metadata").unlink()
    assert sorted(integrity.verify_step(step_dir).problems) == [
        "meta/metadata is missing", "state/planted is not in the saved checksums"]

    older = run_dir / "checkpoints" / "20"  # as saved by a trainrun from before checksums
    for item in integrity.ITEMS:
        (older / item / integrity.MANIFEST).unlink()
    assert not integrity.verify_step(older).checked
    (step_dir / "state" / integrity.MANIFEST).unlink()  # only some: damage, not age
    assert "state/ has no trainrun-checksums.json" in integrity.verify_step(step_dir).problems
