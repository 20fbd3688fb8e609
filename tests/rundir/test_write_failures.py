"""A write the file system refuses: one line naming the file and the last committed checkpoint,
exit 1, status ``failed``, no temporary files, no partial metrics record; once the disk has room
the same command resumes bit for bit. Real full and read-only file systems are tiny tmpfs mounts
(root only: skipped elsewhere, with the reason)."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env, losses

from trainrun import rundir
from trainrun.config import load_config
from trainrun.errors import WriteFailed
from trainrun.reporting.sinks import jsonl
from trainrun.reporting.sinks.jsonl import JsonlWriter, read_metrics
from trainrun.rundir import write_failures
from trainrun.training.loop import run

RUN = ["steps=1000", "checkpoint.every=100", "metrics.every=500"]


def trainrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainrun", *args], capture_output=True,
                          text=True, timeout=300, env=cli_env())


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs at tmp_path/mnt, unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mount -t tmpfs is not allowed here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> np.ndarray:
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    run(load_config("mlp", RUN), run_dir, out=io.StringIO())
    return losses(run_dir)


def leftovers(path: Path) -> list[str]:
    return [str(p) for p in path.rglob("*") if p.name.endswith(".tmp") or "-tmp" in p.name]


# Free space left for the run (KiB): where it runs out differs (its marker, the metrics and
# TensorBoard files, a checkpoint being saved); each must end the same way.
@pytest.mark.slow
@pytest.mark.parametrize("free_kib", [12, 90, 400])
def test_full_disk_is_one_line_and_resumes_bit_for_bit(tmpfs, whole, free_kib):
    filler = tmpfs / "filler"
    filler.write_bytes(b"\0" * ((1024 - free_kib) * 1024))
    run_dir = tmpfs / "run"
    failed = trainrun("train", "--run-dir", str(run_dir), *RUN)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert failed.stderr.count("\n") == 1, failed.stderr[-3000:]  # no traceback, no logs
    line = failed.stderr.strip()
    assert line.startswith("error: no space left on device writing ")
    committed = rundir.committed_steps(run_dir / "checkpoints")
    assert line.endswith(f"the last committed checkpoint is step {committed[-1]} (the same "
                         "command resumes from it once the write can succeed)"
                         if committed else "no checkpoint was committed")
    assert leftovers(tmpfs) == []
    if (run_dir / rundir.METRICS).exists():  # whole records only
        text = (run_dir / rundir.METRICS).read_text()
        assert not text or text.endswith("\n")
        [json.loads(record) for record in text.splitlines()]
    status = rundir.read_status(run_dir) if (run_dir / rundir.STATUS).exists() else {}
    if status:
        assert status["status"] == "failed" and status["reason"] == line.removeprefix("error: ")

    filler.unlink()  # room again: the same command finishes the run
    resumed = trainrun("train", "--run-dir", str(run_dir), *RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if committed:
        assert f"resumed from step {committed[-1]}" in resumed.stdout
    assert losses(run_dir).tobytes() == whole.tobytes()
    assert rundir.read_status(run_dir)["status"] == "finished"


@pytest.mark.slow
def test_read_only_directory_is_one_line_and_resumes(tmpfs, tmp_path):
    run_dir = tmpfs / "run"
    first = trainrun("train", "--run-dir", str(run_dir), "steps=200", "checkpoint.every=100",
                     "metrics.tensorboard=false")
    assert first.returncode == 0, first.stderr[-3000:]
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        refused = trainrun("train", "--run-dir", str(run_dir), "steps=400",
                           "checkpoint.every=100", "metrics.tensorboard=false")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
    assert refused.stderr.startswith(f"error: read-only file system writing {run_dir}/")
    assert "the last committed checkpoint is step 200" in refused.stderr
    again = trainrun("train", "--run-dir", str(run_dir), "steps=400", "checkpoint.every=100",
                     "metrics.tensorboard=false")
    assert again.returncode == 0 and "resumed from step 200" in again.stdout
    assert [r["step"] for r in read_metrics(run_dir / rundir.METRICS)] == list(range(1, 401))


# ---- without a mount -------------------------------------------------------------------------


def test_metrics_file_is_cut_back_to_whole_records_when_a_write_is_refused(tmp_path,
                                                                           monkeypatch):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.write(1, {"loss": 1.0})
    writer.flush()
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(fd: int, data) -> int:  # what a disk filling up mid-write does
        if fd != writer.fd:
            return real_write(fd, data)
        if len(data) > 8:
            return real_write(fd, bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl.os, "write", half_then_full)
    writer.write(2, {"loss": 0.5})
    with pytest.raises(OSError) as raised:
        writer.flush()
    assert raised.value.filename == str(path)  # the one-line report names it
    assert path.read_bytes() == before  # no half record


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "status.json").mkdir()  # the rename fails: a folder is in the way
    (tmp_path / "status.json" / "x").write_text("")
    with pytest.raises(OSError):
        rundir.write_json(tmp_path / "status.json", {"status": "running"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_refused_writes_are_found_through_orbax_and_tensorstore_errors():
    text = ('RESOURCE_EXHAUSTED: Error writing local file "/r/checkpoints/100.orbax-checkpoint-'
            'tmp/state/_sharding": [OS error: No space left on device]')
    try:
        try:
            raise ValueError(text)
        except ValueError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert write_failures.refused_write(outer) == (
            "no space left on device", "/r/checkpoints/100.orbax-checkpoint-tmp/state/_sharding")
    assert write_failures.refused_write(OSError(errno.EROFS, "x", "/a")) == (
        "read-only file system", "/a")
    assert write_failures.refused_write(ValueError("something else")) is None


def test_a_path_in_an_errors_text_is_taken_from_one_line():
    # An error whose text holds a traceback: quotes on different lines are not a path.
    text = ("  File '/venv/orbax/x.py', line 9\n    await ts.open(\nValueError: Error writing "
            "local file \"/mnt/run/ckpt/manifest.ocdbt\": No space left on device")
    what, path = write_failures.refused_write(ValueError(text))
    assert what == "no space left on device" and "\n" not in path
    stray = "opened '/mnt/a\nline two' then \"/mnt/run/f\": No space left on device"
    assert write_failures.refused_write(ValueError(stray))[1] == "/mnt/run/f"


# In a process of its own: what it silences lasts until the process ends.
_AFTER_CLOSE = """
import errno, logging, sys
from pathlib import Path
from trainrun import rundir
from trainrun.rundir import write_failures

logging.basicConfig()  # as absl's handler would print them
orbax, loop = logging.getLogger("absl"), logging.getLogger("asyncio")
refused = ValueError('Error writing local file "/r/ckpt/300.orbax-checkpoint-tmp/_sharding": '
                     'No space left on device')
echo = RuntimeError("cannot schedule new futures after shutdown")

def report(tag):
    orbax.error("%s: thread raised", tag, exc_info=refused)
    loop.error("%s: Task exception was never retrieved", tag, exc_info=echo)
    loop.error("%s: another error", tag, exc_info=KeyError("kept"))
    sys.stderr.flush()

write_failures.quiet_orbax_errors()()  # a checkpoint directory opened, then closed
report("before")
run = Path(sys.argv[1])
directory = rundir.RunDirectory(run, run / "checkpoints")
print(write_failures.on_failure(OSError(errno.ENOSPC, "No space left on device", str(run)),
                                directory), file=sys.stderr)
report("after")
"""


def test_a_refused_saves_reports_after_its_directory_closed_are_dropped(tmp_path):
    """Orbax's threads, and asyncio's tasks that find their executor shut down, report a
    refused save after the checkpoint directory is closed and after the run's one line (seen
    at exit): once that line is written, those reports are dropped; other errors are not."""
    done = subprocess.run([sys.executable, "-c", _AFTER_CLOSE, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode == 0, done.stderr
    before, line, after = done.stderr.partition("no space left on device writing ")
    assert line, done.stderr
    assert "before: thread raised" in before and "before: Task exception" in before
    assert "after: another error" in after and "KeyError: 'kept'" in after
    assert "after: thread raised" not in after and "after: Task exception" not in after


def test_a_write_failed_outside_the_run_keeps_its_own_line(tmp_path):
    """A WriteFailed already names its place (the data cache, say): the run's report does not
    trade it for the OSError behind it, which names no file and so read "in RUN_DIR"."""
    directory = rundir.RunDirectory(tmp_path / "run", tmp_path / "run" / "checkpoints")
    line = "cannot keep the tokenized records in /cache/records: no space left on device; ..."
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise WriteFailed(line)  # noqa: B904 (its context is what the report must not use)
    except WriteFailed as err:
        failure = write_failures.on_failure(err, directory)
    assert isinstance(failure, WriteFailed) and str(failure) == line
    assert not (tmp_path / "run").exists()
