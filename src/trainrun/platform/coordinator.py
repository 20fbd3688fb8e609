"""What a job's coordinator trusts, and what trainrun adds so that a stray process cannot stop
a running job.

JAX's coordination service (process 0 hosts it) accepts any process that reaches its port and
says "I am process i": there is no key or job id. When process i of a running job is already
connected, a second "process i" (another job's, a stale one, a wrong ``distributed.process_id``)
is taken for process i restarted: the service records an error and every process of the job
aborts. JAX offers no way to refuse it first, so trainrun's processes check before they join:

- ``JobPresence``: once a job has formed, its process 0 holds a name on this host (a Linux
  abstract socket named after the coordinator's port; it goes with the process) and answers
  anyone who connects with who it is.
- ``refuse_if_running``: a process about to join asks for that name first; a job already
  running there is refused in one line, before anything reaches the coordinator.
- ``JoinWatch``: while a process waits to join, a coordinator that was reachable and is gone
  (its job ended, perhaps because this process was taken for one it already had) ends the wait
  at once with one line, instead of JAX's retries until ``init_timeout_s``.

A process on another host cannot see the name: the run directory's lock covers it when the run
directory is shared (``training/setup.py``); bind the coordinator to a private interface or
firewall its port (docs/guides/multi-host.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from trainrun.errors import UserError

PROBE_PERIOD_S = 0.25
GONE_AFTER = 3  # refused connections in a row before the coordinator counts as gone
COORDINATOR_GONE_EXIT = 1


class JobRunning(UserError):
    """A job already runs with this coordinator; joining it would stop it. Exit 2."""


def _name(address: str) -> str | None:
    """The name a job with its coordinator at ``address`` holds on this host: by port, so
    that every spelling of this host (127.0.0.1, localhost, its name) finds it; None where
    there is none (not Linux, or a coordinator on another host)."""
    host, _, port = address.rpartition(":")
    if not sys.platform.startswith("linux") or not _on_this_host(host.strip("[]")):
        return None
    return f"\0trainrun-job-port-{port}"


def _on_this_host(host: str) -> bool:
    """Whether ``host`` names this machine: a socket binds only to an address of its own."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.bind((sockaddr[0], 0))
            return True
    return False


class JobPresence:
    """Process 0's sign, on this host, that the job of ``address`` has formed and runs."""

    def __init__(self, address: str, processes: int):
        self.address, self.processes = address, processes
        self.server: socket.socket | None = None

    def start(self) -> None:
        name = _name(self.address)
        if name is None:
            return
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(name)
        except OSError:  # another job's process 0 holds it: its own coordinator would clash
            server.close()
            return
        server.listen(8)
        self.server = server
        threading.Thread(target=self._answer, name="trainrun-job-presence", daemon=True).start()

    def _answer(self) -> None:
        said = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "processes": self.processes}).encode() + b"\n"
        while self.server is not None:
            try:
                peer, _ = self.server.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), peer:
                peer.sendall(said)

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
            server.close()


def refuse_if_running(address: str, process_id: int | None) -> None:
    """Refuse, on one line, to join the coordinator at ``address`` when a job already runs with
    it on this host (its process 0 answers at the name ``JobPresence`` holds)."""
    name = _name(address)
    if name is None:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(name)
            answer: dict[str, Any] = json.loads(probe.makefile().readline() or "{}")
        except (OSError, ValueError):
            return  # nobody holds it: no job of this coordinator runs here
    who = (f"process 0 is pid {answer.get('pid')} on {answer.get('host')}, "
           f"{answer.get('processes')} processes" if answer else "its process 0 answered")
    if process_id == 0:
        why = "this process cannot host a coordinator there; give one a free port"
    else:
        why = (f"joining it as process {process_id} would stop that job (its coordinator takes "
               "a process naming an id it has for that process restarted); check "
               "distributed.coordinator and distributed.process_id")
    raise JobRunning(f"a job is already running with its coordinator at {address} ({who}): "
                     f"{why}")


class JoinWatch:
    """While this process joins the coordinator at ``address``: if the coordinator was
    reachable and then refuses connections, it is gone, and this process exits with one line."""

    def __init__(self, address: str):
        host, _, port = address.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.address = address
        self.done = threading.Event()

    def _reachable(self) -> bool | None:
        """True: it accepts; False: refused; None: no answer yet (it may be starting)."""
        try:
            with socket.create_connection(self.target, timeout=PROBE_PERIOD_S * 4):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:
            return None

    def _run(self) -> None:
        seen, refused = False, 0
        while not self.done.wait(PROBE_PERIOD_S):
            state = self._reachable()
            if self.done.is_set():
                return
            seen = seen or bool(state)
            refused = refused + 1 if seen and state is False else 0
            if refused >= GONE_AFTER:
                sys.stderr.write(
                    f"error: the coordinator at {self.address} went away while this process "
                    "was joining it: its job ended (if that job was already running, it had "
                    "this distributed.process_id, and this process's arrival stopped it); "
                    "check distributed.coordinator and distributed.process_id\n")
                sys.stderr.flush()
                os._exit(COORDINATOR_GONE_EXIT)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        thread = threading.Thread(target=self._run, name="trainrun-join-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.done.set()
            thread.join()
