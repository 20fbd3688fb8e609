"""Several processes of one run: `trainrun launch` (jax.distributed, gloo), equality with one
process holding the same devices, and what happens when a process dies or fails."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cli_env, run_cli

from trainrun.config import ExplicitDistributed
from trainrun.platform import distributed
from trainrun.reporting.sinks.jsonl import read_metrics

RUN = ["model.hidden=[32]", "data.examples=512", "data.batch_size=64", "data.shuffle=true",
       "metrics.every=10", "metrics.tensorboard=false"]


def losses(run_dir) -> np.ndarray:
    return np.array([r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")], np.float64)


def launch(*args: str, devices: int | None = None, timeout: float = 300):
    return run_cli("launch", "-n", "2", *(["--devices-per-process", str(devices)] if devices
                                          else []), "--", *args, timeout=timeout)


def slurm_env(process: int, port: int) -> dict[str, str]:
    """What `srun --ntasks=2` on one node puts in each task's environment."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(process), "SLURM_LOCALID": str(process),
            "JAX_COORDINATOR_PORT": str(port), "JAX_PLATFORMS": "cpu"}


def slurm_train(run_dir, *overrides: str) -> list[subprocess.CompletedProcess[str]]:
    """``trainrun train ... distributed=auto`` as two tasks of 2 devices each, in the
    environment `srun --ntasks=2` gives them: JAX's own SLURM detection forms the group."""
    port = distributed.free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "trainrun", "train", "--run-dir", str(run_dir), *overrides,
         "distributed=auto"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=cli_env(2, **slurm_env(i, port))) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "")
            for p, out in zip(procs, outputs, strict=True)]


@pytest.mark.slow
def test_two_processes_equal_one_process_and_checkpoints_restore_across(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = run_cli("train", "--run-dir", str(one), *RUN, "steps=20", devices=4)
    assert single.returncode == 0, single.stderr[-3000:]
    # (5 steps per call: each process also feeds its rows of stacked [K, B, ...] batches)
    # An option between the overrides: launch appends its own after them.
    launched = launch("train", *RUN, "steps=20", "--run-dir", str(two), "steps_per_call=5",
                      devices=2)
    assert launched.returncode == 0, launched.stdout[-3000:]
    assert len(losses(one)) == len(losses(two)) == 20  # process 0 wrote each step once
    # Not bitwise: across processes gloo sums the gradients in another order than XLA does
    # within one process (measured: grad_norm differs in its last bit from step 1 on).
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-6, atol=0)
    out = launched.stdout
    assert "[0] step 20/20" in out and "[1] step" not in out  # only process 0 logs
    assert "[launch] process 0 exited with status 0" in out and "2 process(es)" in out

    # Checkpoints restore across process counts: 1 -> 2 (two SLURM tasks, distributed=auto)
    # and 2 -> 1, each continuing to step 30.
    tasks = slurm_train(one, *RUN, "steps=30")
    assert [t.returncode for t in tasks] == [0, 0], tasks[0].stdout[-2000:]
    assert f"resumed from step 20 ({one / 'checkpoints' / '20'})" in tasks[0].stdout
    resumed = run_cli("train", "--run-dir", str(two), *RUN, "steps=30", devices=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step 20 ({two / 'checkpoints' / '20'})" in resumed.stdout
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 30
    # Each continued from its own saved state: still within 1e-6 of each other (a fresh
    # state, or a wrong data position, would be far off).
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=0)


def kill_one_while_training(run_dir: Path, victim: int, busy: int = 0, *train: str):
    """``trainrun launch -n 2 -- train ...``, with ``busy`` busy-loop processes beside it; once
    its first checkpoint is committed, ``kill -9`` process ``victim``. Returns the launcher's
    return code, its output, the victim's pid and how long the job took to end after the kill."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    proc = subprocess.Popen([sys.executable, "-m", "trainrun", "launch", "-n", "2", "--", *train,
                             "steps=10000000"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env(None))
    lines, pids = [], {}
    try:
        for line in proc.stdout:  # until the first checkpoint is committed
            lines.append(line)
            if line.startswith("[launch] process") and ": pid " in line:
                pids[int(line.split()[2])] = int(line.split()[-1])
            if line.startswith("[0] step") and (run_dir / "checkpoints" / "100").is_dir():
                break
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        rest, _ = proc.communicate(timeout=180)
        stopped_after = time.monotonic() - killed_at
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines) + rest, pids[victim], stopped_after


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def assert_no_native_lines(out: str) -> None:
    """XLA's and gRPC's own lines (a log line, a check's stack, a status's details) held back."""
    for line in out.splitlines():
        text = line.split("] ", 1)[-1] if line.startswith("[") else line
        assert not distributed.NATIVE_LOG.match(text), line
        assert not re.search(r"Check failure|GRPC|grpc_|@\s+0x|absl::|coordination_service",
                             text), line


def assert_ended_by_the_launcher(out: str, run_dir: Path, victim: int, pid: int) -> None:
    """The launcher's own last line names the dead process and its signal; the run is
    ``failed`` with that reason, at the last committed step."""
    last = committed_steps(run_dir)[-1]
    line = (f"process {victim} of 2 (pid {pid}) died of signal SIGKILL (killed from outside: "
            "kill -9, or the system's out-of-memory killer), which stopped the job; the last "
            f"committed checkpoint is step {last} (the same command resumes from it)")
    assert out.splitlines()[-1] == f"[launch] error: {line}", out[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"], status["reason"]) == ("failed", last, line)


@pytest.mark.slow
@pytest.mark.parametrize("busy", [0, 4], ids=["idle", "4-busy-processes"])
def test_a_lost_process_stops_the_others_naming_it_and_a_relaunch_resumes(tmp_path, busy):
    """Also with two busy processes per core beside it, where JAX's coordination service may
    abort process 0 before its own watch names process 1: either way the launcher's line says
    what happened and the run's status records it. Before, that abort ended the job with
    XLA's stack trace, exit 134."""
    run_dir = tmp_path / "run"
    train = ["train", "--run-dir", str(run_dir), *RUN, "metrics.every=100", "checkpoint.every=100",
             "distributed.peer_timeout_s=5"]
    code, out, pid, stopped_after = kill_one_while_training(run_dir, 1, busy, *train)
    assert code == 128 + signal.SIGKILL, out[-3000:]  # the first failure
    assert "[launch] process 1 exited with signal SIGKILL" in out
    watched = ("[0] error: process 1 of 2 stopped responding (no heartbeat for 5 s: it died, "
               "hung or lost the network); stopping this process too")
    if busy == 0:
        assert watched in out, out[-3000:]
        assert f"[launch] process 0 exited with status {distributed.PEER_LOST_EXIT}" in out
    else:  # whichever noticed first
        assert (watched in out) != ("[launch] process 0 exited with signal SIGABRT" in out)
    assert_ended_by_the_launcher(out, run_dir, 1, pid)
    assert_no_native_lines(out)
    assert stopped_after < 60, out[-3000:]

    # The same command again resumes from the newest committed checkpoint and finishes.
    latest = committed_steps(run_dir)[-1]
    done = launch(*train, f"steps={latest + 10}")
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"[0] resumed from step {latest} " in done.stdout
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, latest + 11))


@pytest.mark.slow
def test_a_dead_process_0_ends_the_job_in_the_launchers_line(tmp_path):
    """Process 0 hosts JAX's coordinator: when it dies, JAX aborts the others at once. Before,
    the job ended with their gRPC errors and XLA's stack traces and status.json still said
    ``running``."""
    run_dir = tmp_path / "run"
    train = ["train", "--run-dir", str(run_dir), *RUN, "metrics.every=100", "checkpoint.every=100",
             "distributed.peer_timeout_s=5"]
    code, out, pid, stopped_after = kill_one_while_training(run_dir, 0, 0, *train)
    assert code == 128 + signal.SIGKILL, out[-3000:]
    assert "[launch] process 0 exited with signal SIGKILL" in out
    assert_ended_by_the_launcher(out, run_dir, 0, pid)
    assert_no_native_lines(out)
    assert stopped_after < 60, out[-3000:]


@pytest.mark.slow
def test_a_failure_in_one_process_stops_the_others_with_its_message(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("not a trainrun run\n")
    done = launch("train", "--run-dir", str(run_dir), *RUN, "steps=5")
    assert done.returncode == 2, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    # Only process 0 checks the run directory; process 1 stops with process 0's message.
    error = next(line for line in lines if line.startswith("[0] error: "))
    assert f"[1] error: process 0 of 2 failed: {error[len('[0] error: '):]}" in lines
    assert (run_dir / "notes.txt").read_text() == "not a trainrun run\n"  # nothing lost


def test_explicit_start_up_needs_its_three_values():
    with pytest.raises(distributed.DistributedError,
                       match=r"distributed\.kind=explicit needs num_processes, process_id"):
        distributed.initialize(ExplicitDistributed(coordinator="10.0.0.1:1234"))
    with pytest.raises(distributed.DistributedError, match=r"'10\.0\.0\.1' is not HOST:PORT"):
        distributed.initialize(ExplicitDistributed(coordinator="10.0.0.1", num_processes=2,
                                                   process_id=0))
    with pytest.raises(distributed.DistributedError, match="process_id 2 is not below"):
        distributed.initialize(ExplicitDistributed(coordinator="h:1", num_processes=2,
                                                   process_id=2))


@pytest.mark.slow
def test_auto_without_a_cluster_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    done = subprocess.run([sys.executable, "-m", "trainrun", "train", "--run-dir",
                           str(tmp_path / "r"), "distributed=auto"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("error: distributed=auto found no cluster to join (SLURM, ")
    assert done.stderr.count("\n") == 1


# ---- what the coordinator trusts -------------------------------------------------------------


def test_a_job_running_here_refuses_a_process_that_would_join_it(tmp_path):
    """Its process 0's sign is found under any spelling of this host; with it gone, or for a
    coordinator elsewhere, nothing is refused."""
    from trainrun.platform import coordinator

    port = distributed.free_port()
    presence = coordinator.JobPresence(f"127.0.0.1:{port}", 2)
    presence.start()
    try:
        with pytest.raises(coordinator.JobRunning, match=(
                rf"a job is already running with its coordinator at localhost:{port} \(process "
                rf"0 is pid {os.getpid()} on .*, 2 processes\): joining it as process 1 would "
                "stop that job")):
            coordinator.refuse_if_running(f"localhost:{port}", 1)
    finally:
        presence.stop()
    coordinator.refuse_if_running(f"localhost:{port}", 1)
    coordinator.refuse_if_running(f"10.255.0.1:{port}", 1)


def test_a_run_directory_in_use_is_refused_before_its_coordinator_is_reached(tmp_path):
    from trainrun.rundir.lock import RunDirLocked, RunLock, refuse_joining

    held = RunLock(tmp_path)
    held.acquire(create=True)
    held.record_holder()
    reached = []
    try:
        with pytest.raises(RunDirLocked, match=rf"in use by another trainrun run \(pid "
                                               rf"{os.getpid()} .*joining that job's coordinator"):
            distributed.initialize(
                ExplicitDistributed(coordinator=f"127.0.0.1:{distributed.free_port()}",
                                    num_processes=2, process_id=1),
                before_joining=lambda: (reached.append("checked"), refuse_joining(tmp_path)))
    finally:
        held.release()
    assert reached == ["checked"] and not jax.distributed.is_initialized()


def test_a_joiner_whose_coordinator_goes_away_stops_at_once():
    """Instead of JAX's retries for init_timeout_s (the job it would have joined is gone)."""
    script = """
import socket, threading, time
from trainrun.platform.coordinator import JoinWatch
server = socket.create_server(("127.0.0.1", 0))
port = server.getsockname()[1]
threading.Timer(1.0, server.close).start()
with JoinWatch(f"127.0.0.1:{port}").watching():
    time.sleep(60)
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=cli_env())
    assert done.returncode == 1 and time.monotonic() - started < 30, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "error: the coordinator at 127.0.0.1:")
    assert "went away while this process was joining it" in done.stderr


@pytest.mark.slow
def _without_background_commit_report(lines: list[str]) -> list[str]:
    """``lines`` less what a process printed from Orbax's background commit on: when the
    coordinator stops the job while a checkpoint's commit waits at its barrier, that thread
    logs the failed barrier and its traceback (the checkpoint is not committed, and no other
    line is printed by the process after it)."""
    out, cut = [], set()
    for line in lines:
        who = line.split(" ", 1)[0]
        if "in background save thread" in line and "Failed to run" in line:
            cut.add(who)
        if who not in cut:
            out.append(line)
    return out


def test_a_stranger_at_the_coordinator_is_refused_or_ends_the_job_in_one_line(tmp_path):
    """A trainrun process that names a running job's coordinator and one of its ids is refused
    and the job goes on; a bare JAX process doing the same, which nothing can refuse, makes
    JAX's coordinator stop the job: the launcher says so in one line and records it. Before,
    the launcher exited 134 with XLA's stack traces, status.json said running, and the
    stranger waited silently."""
    run_dir = tmp_path / "run"
    train = ["train", "--run-dir", str(run_dir), *RUN, "metrics.every=100", "checkpoint.every=100",
             "distributed.peer_timeout_s=5", "steps=10000000"]
    proc = subprocess.Popen([sys.executable, "-m", "trainrun", "launch", "-n", "2", "--",
                             *train], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cli_env(None))
    lines: list[str] = []

    def read_until(done) -> None:
        for line in proc.stdout:
            lines.append(line)
            if done():
                return

    def committed() -> list[int]:
        steps = run_dir / "checkpoints"
        return sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) if (
            steps.is_dir()) else []

    try:
        read_until(lambda: bool(committed()))
        pid = int(next(line for line in lines if "process 0 of 2: pid" in line).split()[-1])
        port = next(a for a in Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                    if a.startswith("distributed.coordinator=")).rsplit(":", 1)[1]
        joining = ["distributed.kind=explicit", f"distributed.coordinator=localhost:{port}",
                   "distributed.num_processes=2", "distributed.process_id=1"]
        stranger = run_cli("train", "--run-dir", str(tmp_path / "other"), *RUN, *joining)
        assert stranger.returncode == 2, stranger.stderr
        assert stranger.stderr.count("\n") == 1 and stranger.stderr.startswith(
            f"error: a job is already running with its coordinator at localhost:{port}")
        assert not (tmp_path / "other").exists()
        seen = committed()[-1]
        read_until(lambda: committed()[-1] > seen)  # the job goes on
        bare = subprocess.Popen([sys.executable, "-c", "import jax; jax.distributed.initialize("
                                 f"'127.0.0.1:{port}', 2, 1, initialization_timeout=5)"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=cli_env(JAX_PLATFORMS="cpu"))
        rest, _ = proc.communicate(timeout=120)
        bare.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == distributed.JOB_STOPPED_EXIT, out[-3000:]
    # A process whose collective failed as the coordinator stopped the job may first say it is
    # checking for a lost process (its runtime's reason quoted: "Read error" and the like).
    shown = _without_background_commit_report(out.splitlines())
    errors = [line for line in shown
              if "error" in line.lower() and "checking for a lost process" not in line]
    last = committed()[-1]
    assert errors == [
        f"[launch] error: a process that is not this job's joined its coordinator at "
        f"127.0.0.1:{port} as process 1 (another job's, a stale one, or a wrong "
        "distributed.process_id); JAX's coordinator cannot refuse it and stopped every "
        f"process of this job; the last committed checkpoint is step {last} (the same command "
        "resumes from it)"], out[-3000:]
    # XLA's own lines held back (the commit thread's report quotes its barrier's RPC status)
    assert not [line for line in shown if "Check failure" in line or "RPC:" in line], out[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == last
    assert status["reason"] == errors[0][len("[launch] error: "):]
