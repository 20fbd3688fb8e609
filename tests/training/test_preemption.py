"""Preemption: SIGTERM/SIGINT end a run after the current call with a checkpoint and exit 0; a
second signal of either kind aborts at once (130 for SIGINT, 143 for SIGTERM); several
processes save the same step."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import FAULT_STACKS, cli_env, finish

from trainrun import rundir
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.preemption import ABORT_EXIT_CODE, Preemption


def start(*args: str, stderr_to, **env: str) -> subprocess.Popen:
    """A Python process whose stdout is read line by line (stderr to a file: never blocks)."""
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=stderr_to.open("w"), text=True,
                            env=cli_env(**FAULT_STACKS, **env))


def wait_for(stream, pattern: str) -> list[str]:
    seen = []
    for line in stream:
        seen.append(line)
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"{pattern!r} never appeared in:\n{''.join(seen)[-3000:]}")


@pytest.mark.slow
def test_sigterm_finishes_the_call_saves_and_exits_zero(cli, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "stderr.txt"
    train = start("-m", "trainrun", "train", "--run-dir", str(run_dir), "steps=10000000",
                  "metrics.every=100", "checkpoint.every=0", "metrics.tensorboard=false",
                  stderr_to=log)
    wait_for(train.stdout, r"step +100/")
    train.send_signal(signal.SIGTERM)
    out, _ = finish(train, 120)
    err = log.read_text()
    assert train.returncode == 0, err[-3000:]
    assert "SIGTERM received" in err
    stopped = [line for line in out.splitlines() if line.startswith("preempted (SIGTERM)")]
    assert len(stopped) == 1, out[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert step >= 100 and f"checkpoint saved to {run_dir.absolute()}/checkpoints/{step}" in (
        stopped[0])
    assert sorted(os.listdir(run_dir / "checkpoints")) == [str(step)]  # committed, no tmp
    assert [r["step"] for r in read_metrics(run_dir / rundir.METRICS)] == list(
        range(1, step + 1))
    assert rundir.read_status(run_dir)["status"] == "preempted"

    resumed = cli("train", "--run-dir", str(run_dir), f"steps={step + 5}",
                  "metrics.tensorboard=false")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {step}" in resumed.stdout
    assert len(read_metrics(run_dir / rundir.METRICS)) == step + 5


def test_signal_requests_a_stop_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as preemption:
        assert not preemption.requested(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested(2) and preemption.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [("SIGINT", "SIGINT"), ("SIGTERM", "SIGTERM"),
                                          ("SIGINT", "SIGTERM"), ("SIGTERM", "SIGINT")])
def test_a_second_signal_aborts_at_once_with_its_exit_code(tmp_path, first, second):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from trainrun.training.preemption import Preemption
        with Preemption() as preemption:
            preemption.on_abort = lambda name: print("recorded", name, flush=True)
            os.kill(os.getpid(), signal.{first})
            time.sleep(0.2)
            assert preemption.requested(1)
            os.kill(os.getpid(), signal.{second})
            time.sleep(30)
            print("still running")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=cli_env())
    again = "interrupt again" if first == "SIGINT" else "send SIGTERM again"
    assert f"{first} received: finishing the current call, then saving a checkpoint ({again} " \
           "to abort at once)" in done.stderr
    assert done.returncode == 128 + getattr(signal, second), done.stderr[-3000:]
    assert done.returncode == (ABORT_EXIT_CODE if second == "SIGINT" else 143)
    assert f"aborted by a second {second}: exiting at once" in done.stderr
    assert done.stdout == f"recorded {second}\n"  # the run's status is told, then the exit


HOST = """\
import sys, time
import jax
index, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index)
from trainrun.training.preemption import Preemption
with Preemption() as preemption:
    for step in range(1, 10**6):
        time.sleep(0.002 * (1 + index))  # the hosts run at different speeds
        if step == 20:
            print("ready", flush=True)
        if preemption.requested(step):
            print("stop", step, flush=True)
            break
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_hosts_agree_on_the_step_when_one_is_signalled(tmp_path):
    script = tmp_path / "host.py"
    script.write_text(HOST)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    logs = [tmp_path / f"host{i}.txt" for i in range(2)]
    hosts = [start(str(script), str(i), port, stderr_to=logs[i]) for i in range(2)]
    for host in hosts:
        wait_for(host.stdout, "ready")
    hosts[1].send_signal(signal.SIGINT)  # handed on as SIGTERM to JAX's preemption notifier
    stops = []
    for host, log in zip(hosts, logs, strict=True):
        out, _ = finish(host, 120)
        assert host.returncode == 0, log.read_text()[-3000:]
        stops.append(out.split("stop ")[1].split()[0])
    assert stops[0] == stops[1]
