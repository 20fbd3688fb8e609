"""A file trainrun writes is replaced whole by a rename and never written through a link: not
at its own name, not at a temporary name placed in advance."""

from __future__ import annotations

import errno
import os

import pytest

from trainrun import rundir
from trainrun.storage import atomic


def test_write_text_never_writes_through_a_link_placed_at_its_temporary_name(tmp_path):
    """Before, `status.json.tmp` linking elsewhere had the file elsewhere overwritten."""
    secret = tmp_path / "secret"
    secret.write_text("mine\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json.tmp").symlink_to(secret)
    (run_dir / "summary.json").symlink_to(secret)
    rundir.write_json(run_dir / rundir.STATUS, {"status": "running"})
    rundir.write_json(run_dir / rundir.SUMMARY, {"final_loss": 1.0})
    assert secret.read_text() == "mine\n"
    assert rundir.read_json(run_dir / rundir.STATUS) == {"status": "running"}
    assert not (run_dir / rundir.SUMMARY).is_symlink()
    assert rundir.read_json(run_dir / rundir.SUMMARY) == {"final_loss": 1.0}
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "status.json", "status.json.tmp", "summary.json"]


def test_a_refused_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "report.html"
    path.write_text("old\n")

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left") as err:
        atomic.replace_file(path, "new\n")
    assert err.value.filename == str(path) and err.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    assert path.read_text() == "old\n"


def test_create_new_refuses_any_name_already_there(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # dangling: would create a file there
    with pytest.raises(FileExistsError):
        atomic.create_new(tmp_path / "link")
    assert not (tmp_path / "nowhere").exists()
