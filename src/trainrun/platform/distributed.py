"""Several processes, one program: joining them on ``jax.distributed``, watching each other,
and ``trainrun launch``, which starts N of them on this machine.

Once joined, ``jax.devices()`` lists every device of every process and one jitted program runs
over all of them; the mesh spans processes like it spans devices. What this module adds is
failure handling: a process that dies, hangs or fails makes the others stop within a bounded
time, with an error that names it, instead of waiting forever in a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax

from trainrun.config import AutoDistributed, ExplicitDistributed, SingleProcess
from trainrun.errors import UserCodeFailed, UserError
from trainrun.platform import coordinator
from trainrun.platform.accelerator import one_process_device
from trainrun.platform.process import with_device_count

DistributedConfig = SingleProcess | AutoDistributed | ExplicitDistributed
PEER_LOST_EXIT = 3  # exit status of a process stopped because another was lost


class DistributedError(UserError):
    """A process group that cannot be formed as configured; one line, exit 2."""


# ---- joining ---------------------------------------------------------------------------------

_watch: PeerWatch | None = None
_presence: coordinator.JobPresence | None = None


def initialize(cfg: DistributedConfig,
               before_joining: Callable[[], None] | None = None) -> PeerWatch | None:
    """Join the process group ``cfg`` describes (once per process) and start watching the other
    processes. Must run before anything else touches JAX's devices. ``none``: nothing to do.

    before_joining: a check that may refuse this process before it reaches the coordinator
    (a run directory a running job holds). A coordinator named here is checked too: a job
    already running with it on this host is refused (``coordinator.py``)."""
    global _watch, _presence
    if cfg.kind == "none" or jax.distributed.is_initialized():
        return _watch
    options: dict[str, Any] = {
        "initialization_timeout": cfg.init_timeout_s,
        # JAX's heartbeat aborts the process when a peer is silent this long: the backstop
        # behind PeerWatch, which reports the same loss sooner and by name.
        "heartbeat_timeout_seconds": max(2, round(2 * cfg.peer_timeout_s)),
    }
    if isinstance(cfg, ExplicitDistributed):
        options.update(_explicit_options(cfg))
    address, me = options.get("coordinator_address"), options.get("process_id")
    if address is not None:  # JAX's coordinator cannot refuse a second process of an id
        coordinator.refuse_if_running(address, me)
    if before_joining is not None:
        before_joining()
    # Cross-process collectives on CPU go over gloo (TCP); GPUs and TPUs bring their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = options.get("coordinator_address", "the detected cluster")
    joining = (coordinator.JoinWatch(address).watching() if address is not None and me != 0
               else contextlib.nullcontext())
    try:
        with joining:
            jax.distributed.initialize(**options)
    except Exception as err:  # the coordinator unreachable, a port taken, a timeout, ...
        raise _join_error(cfg, err, where) from None
    if jax.process_count() > 1:
        _watch = PeerWatch(jax.process_index(), jax.process_count(), cfg.peer_timeout_s)
        _watch.start()
        if jax.process_index() == 0 and address is not None:  # the job has formed
            _presence = coordinator.JobPresence(address, jax.process_count())
            _presence.start()
    return _watch


def _join_error(cfg: DistributedConfig, err: Exception, where: str) -> DistributedError:
    """The one line for ``jax.distributed.initialize`` failing with ``err``."""
    if isinstance(err, RuntimeError) and "must be called before" in str(err):
        return DistributedError("distributed start-up must come before any use of JAX "
                                "devices; call trainrun.run (or distributed.initialize) first")
    if isinstance(err, ValueError):
        if cfg.kind == "auto":
            return DistributedError("distributed=auto found no cluster to join (SLURM, Open MPI, "
                                    "Cloud TPU, ...); run under one, use `trainrun launch` on "
                                    "one machine, or set distributed.kind=explicit with "
                                    "coordinator, num_processes and process_id")
        return DistributedError(f"distributed start-up failed: {_first_line(err)}")
    return DistributedError(f"could not join the processes at {where}: {_first_line(err)}")


def _explicit_options(cfg: ExplicitDistributed) -> dict[str, Any]:
    coordinator, count, me = cfg.coordinator, cfg.num_processes, cfg.process_id
    if coordinator is None or count is None or me is None:
        missing = [name for name, value in (("coordinator", coordinator),
                                            ("num_processes", count), ("process_id", me))
                   if value is None]
        raise DistributedError(f"distributed.kind=explicit needs {', '.join(missing)}: set "
                               "distributed.coordinator=HOST:PORT (process 0's address), "
                               "distributed.num_processes=N and distributed.process_id=I")
    if not re.fullmatch(r"[^\s:]+:\d+|\[[0-9a-fA-F:]+\]:\d+", coordinator):
        raise DistributedError(f"distributed.coordinator {coordinator!r} is not HOST:PORT "
                               "(e.g. 10.0.0.1:1234)")
    if me >= count:
        raise DistributedError(f"distributed.process_id {me} is not below "
                               f"distributed.num_processes {count}; ids run 0..{count - 1}")
    return {"coordinator_address": coordinator, "num_processes": count, "process_id": me}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---- watching the others ---------------------------------------------------------------------


class PeerWatch:
    """Heartbeats through the coordinator's key-value store.

    Every second each process bumps its own counter and reads everyone's. A peer whose counter
    has not moved for ``timeout_s`` (by this process's clock: no clock skew between hosts) is
    lost; a peer that recorded a failure has failed. Either way this process prints an error
    naming it and exits at once, from this thread, since the main thread may be blocked in a
    collective that will never complete. Losing the coordinator itself shows as the store
    failing to answer.
    """

    PREFIX = "trainrun/peers/"

    def __init__(self, process_id: int, process_count: int, timeout_s: float,
                 period_s: float = 1.0):
        from jax._src import distributed as jax_distributed  # the store has no public handle

        client = jax_distributed.global_state.client
        if client is None:  # started only after jax.distributed.initialize
            raise DistributedError("the peer watch needs jax.distributed initialized first")
        self.client = client
        self.coordinator = jax_distributed.global_state.coordinator_address
        self.me, self.count = process_id, process_count
        self.timeout_s, self.period_s = timeout_s, period_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="trainrun-peer-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()
        # Stop beating before JAX's own exit handler waits for the others (handlers run last
        # registered first): a process that is leaving must not look alive.
        atexit.register(self.stop)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join()

    def finish(self) -> None:
        """This process is done: the others stop expecting its heartbeat."""
        self.stop()
        self.client.key_value_set(f"{self.PREFIX}done/{self.me}", "", allow_overwrite=True)

    def fail(self, message: str, code: int) -> None:
        """Tell the others this process failed, so they stop now with its message."""
        self.stop()
        with contextlib.suppress(Exception):  # the coordinator may be what failed
            self.client.key_value_set(f"{self.PREFIX}failed/{self.me}", f"{code} {message}",
                                      allow_overwrite=True)
            # Stay until the others have read it (briefly): if this process hosts the
            # coordinator, leaving at once would stop them with JAX's "socket closed" instead.
            deadline = time.monotonic() + 3 * self.period_s
            while time.monotonic() < deadline:
                keys = {key for key, _ in self.client.key_value_dir_get(self.PREFIX)}
                if all(any(f"{self.PREFIX}{kind}/{peer}" in keys for kind in
                           ("seen", "done", "failed")) for peer in range(self.count)):
                    break
                time.sleep(0.05)

    def settle(self) -> None:
        """Give the watch one timeout to find a lost peer (it exits the process if it does).

        When a peer dies mid-collective this process usually sees a transport error first
        (gloo: "connection reset by peer"), which does not say who is gone."""
        self.stopped.wait(self.timeout_s + 2 * self.period_s)

    def _run(self) -> None:
        beats = 0
        seen: dict[int, tuple[str | None, float]] = {}
        start = time.monotonic()
        while not self.stopped.wait(0 if beats == 0 else self.period_s):
            beats += 1
            try:
                self.client.key_value_set(f"{self.PREFIX}beat/{self.me}", str(beats),
                                          allow_overwrite=True)
                entries = dict(self.client.key_value_dir_get(self.PREFIX))
            except Exception as err:
                self._exit(f"lost the coordinator (process 0 at {self.coordinator}): "
                           f"{_first_line(err)}", PEER_LOST_EXIT)
                return  # stopping anyway: the store went away with JAX's shutdown
            now = time.monotonic()
            for peer in range(self.count):
                if peer == self.me or f"{self.PREFIX}done/{peer}" in entries:
                    continue
                failed = entries.get(f"{self.PREFIX}failed/{peer}")
                if failed is not None:
                    code, _, message = failed.partition(" ")
                    with contextlib.suppress(Exception):
                        self.client.key_value_set(f"{self.PREFIX}seen/{self.me}", "",
                                                  allow_overwrite=True)
                    self._exit(f"process {peer} of {self.count} failed: {message}", int(code))
                beat = entries.get(f"{self.PREFIX}beat/{peer}")
                last_beat, since = seen.get(peer, (None, start))
                if beat != last_beat:
                    seen[peer] = (beat, now)
                elif now - since > self.timeout_s:
                    self._exit(f"process {peer} of {self.count} stopped responding (no heartbeat "
                               f"for {self.timeout_s:g} s: it died, hung or lost the network); "
                               "stopping this process too", PEER_LOST_EXIT)

    def _exit(self, message: str, code: int) -> None:
        if self.stopped.is_set():
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        os._exit(code)


@contextlib.contextmanager
def session(cfg: DistributedConfig,
            before_joining: Callable[[], None] | None = None) -> Iterator[None]:
    """Joined for the ``with`` body (``initialize``). If the body fails in a multi-process run,
    the others are told (and stop with this process's message) and this process exits at once:
    waiting for them in JAX's orderly shutdown would only hang."""
    watch = initialize(cfg, before_joining)
    try:
        yield
    except BaseException as err:
        if watch is None:
            raise
        code = 2 if isinstance(err, UserError) else 130 if isinstance(err, KeyboardInterrupt) else 1
        one_line = isinstance(err, UserError | UserCodeFailed)  # a line that says it all
        message = str(err) if one_line else f"{type(err).__name__}: {_first_line(err)}"
        if code == 1 and not one_line:  # it may be the echo of another process's death
            sys.stderr.write(f"this process failed ({_first_line(err)}); checking for a lost "
                             f"process before reporting it ({watch.timeout_s:g} s at most)\n")
            sys.stderr.flush()
            watch.settle()
        watch.fail(message, code)
        if not one_line:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        os._exit(code)
    if watch is not None:
        watch.finish()


# ---- the local launcher ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(devices_per_process: int | None, port: int) -> dict[str, str]:
    """The environment of a launched process: CPU only, unbuffered output, the coordinator
    bound to loopback only, and ``devices_per_process`` simulated devices when given."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
    if devices_per_process is not None:
        env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), devices_per_process)
    return env


# A line of XLA's own log (absl's format) or of the stack trace of a check that failed: held
# back by the launcher, shown only when they explain a failure it cannot name itself.
NATIVE_LOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]|\*\*\* Check failure"
                        r"|\s+@\s+0x|terminate called|  what\(\):|Additional GRPC error")
# The lines after one: a status's details, gRPC's, the ids of the tasks a status names.
NATIVE_MORE = re.compile(r"$|\s|RPC: |absl::Status|\[type\.googleapis|Additional GRPC error"
                         r"|:[A-Z_]+:Error received from peer|\d+(,\d+)*$|The tasks have crashed")
# What JAX's coordination client logs when it aborts its process because the job broke
# (another process died or stopped answering): that process is not the one that failed.
STOPPED_BY_JAX = re.compile(r"JAX distributed service detected fatal errors"
                            r"|Polled an error from coordination service")
# What JAX's coordination service says when a process joins under an id the job has.
INTRUDER = re.compile(r"(?:task:)?(\d+) unexpectedly tried to connect")
JOB_STOPPED_EXIT = 1  # the environment stopped the job, not its input


def launch(n: int, train_args: list[str], devices_per_process: int | None = None,
           grace_s: float = 90.0, out: TextIO | None = None,
           on_job_stopped: Callable[[str, list[str], int], str] | None = None) -> int:
    """Run ``trainrun <train_args>`` as ``n`` processes of one run on this machine.

    Each gets ``distributed.kind=explicit`` with a coordinator on 127.0.0.1 at a free port;
    their output is streamed line by line, prefixed ``[i]``. Returns 0 if all succeed, else the
    status of the first to fail (128 + signal for a killed one). Once one has failed the others
    get ``grace_s`` seconds to stop by themselves (they do, within their peer timeout) before
    they are terminated.

    A process that died of a signal (``kill -9``, the out-of-memory killer, a crash) cannot say
    so itself, and when it is process 0 the coordinator goes with it and JAX aborts the others
    with its native logs: the launcher says it in one ``[launch] error:`` line, holds back the
    logs of the processes that stopped because of it, and ``on_job_stopped(line, process 0's
    train command, its pid)`` records it (the run's status) and returns the line to print.
    A process that is not the job's joining its coordinator under an id the job has makes JAX's
    coordination service abort every process (``coordinator.py``): that is said and recorded
    the same way (exit 1).
    """
    if not train_args or train_args[0] != "train":
        raise DistributedError("trainrun launch runs a training command: "
                               "trainrun launch -n N [--devices-per-process D] -- train [args]")
    if n < 1 or (devices_per_process is not None and devices_per_process < 1):
        raise DistributedError("launch needs -n >= 1 and --devices-per-process >= 1")
    held = one_process_device()
    if held is not None:  # its processes run on the CPU, which no one here asked for
        raise DistributedError(
            f"trainrun launch runs {n} processes of one run on the CPU, and this machine's "
            f"{held} is held by one process at a time: train on the {held} with one process "
            "(trainrun train ...), or set JAX_PLATFORMS=cpu to launch on the CPU")
    port = free_port()
    env = process_env(devices_per_process, port)
    return _Job(n, train_args, port, sys.stdout if out is None else out,
                on_job_stopped).run(env, grace_s)


class _Job:
    """The ``n`` processes ``launch`` starts: their output, their exits and the job's status."""

    def __init__(self, n: int, train_args: list[str], port: int, out: TextIO,
                 on_job_stopped: Callable[[str, list[str], int], str] | None) -> None:
        self.n, self.port, self.out, self.on_job_stopped = n, port, out, on_job_stopped
        self.lock = threading.Lock()
        self.commands = [[*train_args, "distributed.kind=explicit",
                          f"distributed.coordinator=127.0.0.1:{port}",
                          f"distributed.num_processes={n}", f"distributed.process_id={i}"]
                         for i in range(n)]
        self.procs: list[subprocess.Popen[str]] = []
        self.held: list[list[str]] = []  # each process's native log lines
        self.pumps: list[threading.Thread] = []
        self.stopped_by: str | None = None  # the id a process that is not the job's joined under
        self.first_failure: int | None = None
        self.cause: tuple[int, int] | None = None  # the first process to fail and its return code

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(text + "\n")
            self.out.flush()

    def stopped(self, line: str) -> None:
        """The job was stopped by what no process could report: recorded, then said."""
        if self.on_job_stopped is not None:
            with contextlib.suppress(Exception):  # the line goes out however it fares
                line = self.on_job_stopped(line, self.commands[0], self.procs[0].pid)
        self.say(f"[launch] error: {line}")

    def run(self, env: dict[str, str], grace_s: float) -> int:
        """Start the processes, wait for all of them, and return the job's exit status."""
        self.start(env)
        forward = {sig: signal.signal(sig, self.forward_signal)
                   for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.wait(grace_s)
        finally:
            for sig, handler in forward.items():
                signal.signal(sig, handler)
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
        for pump in self.pumps:
            pump.join(timeout=5)
        if self.cause is not None and self.cause[1] < 0 and self.stopped_by is None:
            i, code = self.cause  # every process has exited: what the run's status says is final
            self.stopped(_died(i, self.n, self.procs[i].pid, code, self.echo(i, code)))
        return self.first_failure or 0

    def start(self, env: dict[str, str]) -> None:
        """Start each process and a thread that streams its output."""
        for i, command in enumerate(self.commands):
            self.procs.append(subprocess.Popen([sys.executable, "-m", "trainrun", *command],
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True, bufsize=1, env=env))
            self.say(f"[launch] process {i} of {self.n}: pid {self.procs[-1].pid}")
        self.held = [[] for _ in self.procs]
        self.pumps = [threading.Thread(target=_pump, args=(p.stdout, f"[{i}] ", self.say,
                                                           self.held[i]), daemon=True)
                      for i, p in enumerate(self.procs)]
        for pump in self.pumps:
            pump.start()

    def forward_signal(self, signum: int, _frame: Any) -> None:
        for p in self.procs:
            p.send_signal(signum)

    def wait(self, grace_s: float) -> None:
        """Poll until every process has exited; once one has failed, the others get
        ``grace_s`` seconds before they are terminated, then ten more before they are killed."""
        deadline: float | None = None
        terminated = False
        while any(p.returncode is None for p in self.procs):
            ended = [(i, code) for i, p in enumerate(self.procs)
                     if p.returncode is None and (code := p.poll()) is not None]
            for i, _ in ended:
                self.pumps[i].join(timeout=5)  # its last lines read
            # Found ended together: the one that failed before those its failure stopped.
            for i, code in sorted(ended, key=lambda item: self.echo(*item)):
                if self.record_exit(i, code):
                    deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                self.stop_the_rest(kill=terminated)
                terminated, deadline = True, time.monotonic() + 10
            time.sleep(0.05)

    def record_exit(self, i: int, code: int) -> bool:
        """Say that process ``i`` exited with ``code``; whether it is the job's first failure."""
        self.exited(i, code, first=self.first_failure is None)
        self.say(f"[launch] process {i} exited with {_describe(code)}")
        if code == 0 or self.first_failure is not None:
            return False
        self.first_failure = JOB_STOPPED_EXIT if self.stopped_by else _status(code)
        self.cause = (i, code)
        return True

    def stop_the_rest(self, kill: bool) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.say(f"[launch] process {i} still running after a failure; "
                         f"{'killing' if kill else 'terminating'} it")
                p.kill() if kill else p.terminate()

    def echo(self, i: int, code: int) -> bool:
        """Whether process ``i`` stopped because another failed (trainrun's watch or JAX's
        coordination client stopped it), rather than failing itself."""
        return code == PEER_LOST_EXIT or (
            code < 0 and any(STOPPED_BY_JAX.search(line) for line in self.held[i]))

    def exited(self, i: int, code: int, first: bool) -> None:
        """Name a stranger at the coordinator (once), or else show the held native log lines of
        process ``i`` unless its failure only echoes another's."""
        # process 0 hosts the coordinator: its log names the intruder before anyone aborts
        found = INTRUDER.search("\n".join(line for lines in self.held for line in lines))
        if code != 0 and found is not None:
            if self.stopped_by is None:
                self.stopped_by = found.group(1)
                self.stopped(f"a process that is not this job's joined its coordinator at "
                             f"127.0.0.1:{self.port} as process {self.stopped_by} (another "
                             "job's, a stale one, or a wrong distributed.process_id); JAX's "
                             "coordinator cannot refuse it and stopped every process of this job")
            return
        if code != 0 and (not first or self.echo(i, code)):
            return  # stopped by another's failure: its logs only echo that failure
        for text in self.held[i]:  # not a stop it can name: XLA's own words
            self.say(f"[{i}] {text}")


def _pump(stream: TextIO, prefix: str, say: Any, held: list[str]) -> None:
    """Say each line of ``stream`` with ``prefix``, but hold XLA's native log lines (and the
    lines of one such message: a fatal status runs over several) in ``held``."""
    holding = False
    for line in stream:
        line = line.rstrip("\n")
        holding = bool(NATIVE_LOG.match(line)) or (holding and NATIVE_MORE.match(line) is not None)
        if holding:
            held.append(line)
        else:
            say(prefix + line)


def _died(i: int, n: int, pid: int, returncode: int, stopped_by_jax: bool) -> str:
    """The line for process ``i`` of ``n`` that died of signal ``-returncode``."""
    name = _signal_name(-returncode)
    if stopped_by_jax:  # the process it lost is still running: hung, or cut off
        why = "JAX's coordination client aborted it: another process stopped answering"
    else:
        why = {"SIGKILL": "killed from outside: kill -9, or the system's out-of-memory killer",
               "SIGABRT": "a native crash: its log is above", "SIGSEGV": "a native crash",
               "SIGBUS": "a native crash"}.get(name, "stopped from outside")
    return f"process {i} of {n} (pid {pid}) died of signal {name} ({why}), which stopped the job"


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name of its own
        return str(number)


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"signal {_signal_name(-returncode)} (status {_status(returncode)})"
    return f"status {returncode}"
