"""A device one process at a time holds (a TPU chip): verify-resume runs its chains one after
another and never holds the device itself, launch refuses in one line, a backend start refused
for a device another process holds is one line naming that process, and a run's summary names
the backend's start apart from "other".

The CLI runs here on a CPU made to behave as a TPU host (``one_process_cpu/sitecustomize.py``,
imported by Python at its start in each process the test starts): JAX's import is told it found
TPU chips, and its backend, unless the process asks for the CPU alone, takes an exclusive lock
at start, held until the process exits, and refuses with libtpu's own words when another
process holds it."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from trainrun.cli import main
from trainrun.platform import accelerator, distributed
from trainrun.platform.accelerator import held_device_line, lockfile_holder, one_process_device

ONE_PROCESS_CPU = Path(__file__).resolve().parent / "one_process_cpu"
# libtpu's refusal where it finds no process with the chip's device file open
LOCKFILE_REFUSAL = ("Unable to initialize backend 'tpu': ABORTED: Internal error when accessing "
                    'libtpu multi-process lockfile. Run "$ sudo rm /tmp/libtpu_lockfile". (set '
                    "JAX_PLATFORMS='' to automatically choose an available backend)")


@pytest.fixture
def one_process_cpu(tmp_path: Path) -> dict[str, str]:
    """The environment of a process whose CPU behaves as a TPU host's chip."""
    path = os.pathsep.join(p for p in (str(ONE_PROCESS_CPU), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "DEVICE_LOCK": str(tmp_path / "device.lock")}


@pytest.mark.parametrize("platforms, tpu_host, device", [
    (None, True, "TPU"),  # JAX_PLATFORMS unset on a TPU host
    ("tpu,cpu", True, "TPU"),  # what JAX's import sets there
    ("tpu", True, "TPU"),
    ("cpu", True, None),  # JAX_PLATFORMS=cpu: the chip is not touched
    ("cuda", True, None),
    (None, False, None),  # no chips or no libtpu
    ("tpu,cpu", False, None),
])
def test_a_tpu_is_the_device_one_process_holds(platforms, tpu_host, device):
    assert one_process_device(platforms, tpu_host) == device


def test_libtpus_refusal_names_the_holder_and_jax_platforms():
    message = ("Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by "
               f"process with pid {os.getpid()}. Not attempting to load libtpu.so in this "
               "process. (set JAX_PLATFORMS='' to automatically choose an available backend)")
    line = held_device_line(message, {"JAX_PLATFORMS": "tpu"})
    assert line is not None and "\n" not in line
    assert line.startswith(f"the TPU is held by process {os.getpid()} (")
    assert "python" in line.split("(")[1]  # this process's command, read from /proc
    assert "JAX_PLATFORMS=tpu" in line and line.endswith(
        "stop it, or run on the CPU with JAX_PLATFORMS=cpu")
    other = held_device_line("ABORTED: The TPU is already in use by another process probably "
                             "owned by another user. Run \"$ sudo lsof -w /dev/accel0\"", {})
    assert other is not None and "another user's" in other and "JAX_PLATFORMS unset" in other
    assert held_device_line("Unable to initialize backend 'cuda': no devices", {}) is None


@pytest.fixture
def locked(tmp_path: Path):
    """A lockfile that another process holds locked (with ``lockf``, as libtpu does) and
    open, until the test ends: that process."""
    path = tmp_path / "libtpu_lockfile"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys\n"
         "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
         "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
         "print('held', flush=True)\n"
         "sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    yield path, holder
    holder.communicate("", timeout=60)


def test_the_lockfiles_refusal_names_the_process_that_holds_it(locked):
    """libtpu, finding no process with the chip's device file open, says its lockfile cannot
    be accessed and to remove it, which would let a second process onto a chip the first still
    holds. Before, the line was JAX's error inside one that told to check the driver."""
    path, holder = locked
    line = held_device_line(LOCKFILE_REFUSAL, {"JAX_PLATFORMS": "tpu"}, lockfile=path)
    assert line is not None and "\n" not in line
    assert line.startswith(f"the TPU is held by process {holder.pid} (")
    assert "python" in line.split("(")[1] and "JAX_PLATFORMS=tpu" in line
    assert line.endswith("stop it, or run on the CPU with JAX_PLATFORMS=cpu")
    assert "rm " not in line
    assert lockfile_holder(path) == holder.pid


def test_a_lockfile_no_visible_process_holds_is_another_process(tmp_path):
    """Another user's process is not seen: the line says another process holds the chip and
    never to remove the lockfile."""
    path = tmp_path / "libtpu_lockfile"
    path.write_bytes(b"")  # open and locked by nobody this user can see
    line = held_device_line(LOCKFILE_REFUSAL, {}, lockfile=path)
    assert line is not None and "\n" not in line
    assert line.startswith("the TPU is held by another process, which this user cannot see")
    assert f"`sudo lsof -w {path}` names it" in line and "JAX_PLATFORMS unset" in line
    assert "rm " not in line and line.endswith("JAX_PLATFORMS=cpu")


def _process(proc: Path, pid: int, started: int, opened: list[Path]) -> None:
    """A process's entry in a ``/proc``-like tree: its start time and its open files."""
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "stat").write_text(
        f"{pid} (python3 x) S 1 {pid} {pid} 0 -1 4194304 " + "0 " * 12 + f"{started} 0 0\n")
    for fd, path in enumerate(opened, start=3):
        (proc / str(pid) / "fd" / str(fd)).symlink_to(path)


def test_without_proc_locks_the_holder_is_the_first_started_with_the_lockfile_open(tmp_path):
    """Where ``/proc/locks`` says nothing, the holder is found among the processes with the
    lockfile open: the earliest started (a refused process keeps it open too), never this
    one."""
    lockfile, other = tmp_path / "libtpu_lockfile", tmp_path / "other"
    lockfile.write_bytes(b"")
    other.write_bytes(b"")
    proc = tmp_path / "proc"
    _process(proc, 700, started=900, opened=[lockfile])  # refused, still running
    _process(proc, 800, started=500, opened=[other, lockfile])  # the holder
    _process(proc, 300, started=100, opened=[other])
    _process(proc, os.getpid(), started=1, opened=[lockfile])  # this process
    assert lockfile_holder(lockfile, proc) == 800
    assert lockfile_holder(other, proc) == 300
    (proc / "locks").write_text("")
    assert lockfile_holder(lockfile, proc) == 800


def test_proc_locks_names_the_granted_lock_on_the_lockfiles_inode(tmp_path):
    lockfile = tmp_path / "libtpu_lockfile"
    lockfile.write_bytes(b"")
    found = lockfile.stat()
    device = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}"
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "locks").write_text(
        f"1: POSIX  ADVISORY  WRITE 4242 {device}:{found.st_ino + 1} 0 EOF\n"  # another file
        f"2: POSIX  ADVISORY  WRITE 5151 {device}:{found.st_ino} 0 EOF\n"
        f"2: -> POSIX  ADVISORY  WRITE 6161 {device}:{found.st_ino} 0 EOF\n")  # a waiter
    assert lockfile_holder(lockfile, proc) == 5151
    (proc / "locks").write_text(f"1: POSIX  ADVISORY  WRITE {os.getpid()} {device}:"
                                f"{found.st_ino} 0 EOF\n")
    assert lockfile_holder(lockfile, proc) is None  # this process is never the holder


@pytest.mark.parametrize("refusal", ["pid", "lockfile"])
def test_a_held_chip_is_one_line_naming_its_holder(tmp_path, one_process_cpu, refusal):
    """Before, JAX's error came through whole, inside a line telling to check the driver (and,
    in libtpu's lockfile words, to remove the lock the holder holds)."""
    fd = os.open(one_process_cpu["DEVICE_LOCK"], os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this process holds the "chip"
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        done = run_cli("train", "--run-dir", str(tmp_path / "run"), "steps=2",
                       DEVICE_REFUSAL=refusal, **one_process_cpu)
    finally:
        os.close(fd)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: the TPU is held by process {os.getpid()} (")
    assert "JAX_PLATFORMS unset" in done.stderr and "JAX_PLATFORMS=cpu" in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_summary_names_the_backends_start(tmp_path, one_process_cpu):
    """The backend's start (a TPU runtime's takes seconds; 2 s here) is its own part of the
    wall time; before, it fell in "other"."""
    run_dir = tmp_path / "run"
    done = run_cli("train", "--run-dir", str(run_dir), "steps=4", "metrics.tensorboard=false",
                   DEVICE_START_S="2", **one_process_cpu)
    assert done.returncode == 0, done.stderr[-2000:]
    split = json.loads((run_dir / "summary.json").read_text())["wall_time_split_s"]
    assert split["backend_start"] >= 2.0, split
    assert re.search(r"wall time .*: backend_start \d", done.stdout), done.stdout[-1500:]


@pytest.mark.slow
def test_verify_resume_runs_its_chains_one_after_another(tmp_path, one_process_cpu):
    """Before, the chains started at once and verify-resume held the device itself: every run
    but one was refused at its backend's start."""
    done = run_cli("verify-resume", "--work-dir", str(tmp_path / "verify"), "steps=12",
                   "checkpoint.every=4", "metrics.tensorboard=false", timeout=600,
                   **one_process_cpu)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("verify-resume: one process at a time can hold the TPU: the 3 runs go one after "
            "another\n") in done.stdout
    assert "PASS" in done.stdout


def test_launch_refuses_a_device_one_process_holds(monkeypatch, capsys):
    monkeypatch.setattr(distributed, "one_process_device", lambda: accelerator.TPU)
    assert main(["launch", "-n", "2", "--", "train", "steps=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: trainrun launch runs 2 processes")
    assert "JAX_PLATFORMS=cpu" in err and "trainrun train" in err
