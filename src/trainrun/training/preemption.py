"""Preemption: SIGTERM or SIGINT ends a run at the next call boundary, with a checkpoint.

The loop asks ``requested(step)`` after each call. One process: true once a signal arrived.
Several processes: every host must save the same step, so the answer comes from JAX's
preemption sync point: JAX's runtime catches SIGTERM on any host (``jax.distributed`` installs
its own handler; Python's is not put over it), the coordination service picks a step no host
has passed yet, and each host sees ``True`` at exactly that step. A SIGINT on one host is handed
to that mechanism as a SIGTERM to itself.

A second signal, SIGINT or SIGTERM, aborts at once, without a checkpoint (the last committed
one stays intact; the run's status says which signal ended it), with the shell's code for a
process that signal ended: 130 for SIGINT, 143 for SIGTERM. This is what stops a run whose
current call never ends (a reward that hangs). With several processes SIGTERM stays JAX's,
whose handler only notes the first: there a second SIGTERM changes nothing (a scheduler's
SIGKILL after its grace period ends the process) and a second SIGINT aborts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn, TextIO

import jax
from jax.experimental import multihost_utils

from trainrun.training.hooks import Hook

ABORT_EXIT_CODE = 130  # what a shell reports for a process ended by SIGINT
# The first signal's message: what sends the second
AGAIN = {signal.SIGINT: "interrupt again", signal.SIGTERM: "send SIGTERM again"}
# What signal.signal takes and returns: a handler, SIG_DFL or SIG_IGN, or None (not set from Python)
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preemption(Hook):
    """Signal handling for the duration of a run (a context manager)."""

    def __init__(self, err: TextIO = sys.stderr):
        self.err = err
        self.signal_name: str | None = None  # the first signal received, if any
        # Several processes agree on the step through JAX's service. Decided at the first
        # check, after jax.distributed has started (asking JAX earlier would start it alone).
        self.shared: bool | None = None
        self._previous: dict[int, _Handler] = {}
        # Called with the second signal's name before it ends the process (the run records
        # it as failed).
        self.on_abort: Callable[[str], object] | None = None
        self.asked: tuple[int, bool] = (-1, False)  # the last step asked about, the answer

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        self._install(signal.SIGINT)
        if not jax.distributed.is_initialized():  # else JAX's preemption notifier has SIGTERM
            self._install(signal.SIGTERM)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _install(self, signum: int) -> None:
        self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            self._abort(name, signum)
        self.signal_name = name
        self._say(f"{name} received: finishing the current call, then saving a checkpoint "
                  f"({AGAIN[signal.Signals(signum)]} to abort at once)")
        if self.shared:
            os.kill(os.getpid(), signal.SIGTERM)

    def _abort(self, name: str, signum: int) -> NoReturn:
        """A second signal: the process ends now, with the code of a process that signal ended;
        the status says so."""
        self._say(f"aborted by a second {name}: exiting at once, without a checkpoint of the "
                  "current step (the last committed one stays)")
        if self.on_abort is not None:
            with contextlib.suppress(Exception):
                self.on_abort(name)
        os._exit(128 + signum)

    def _say(self, line: str) -> None:
        """A line on ``err``, straight to its file descriptor where it has one: a handler may
        run in the middle of the program's own write to the stream."""
        if _has_fd(self.err):
            os.write(self.err.fileno(), f"{line}\n".encode())
        else:
            self.err.write(f"{line}\n")

    def handles_interrupts(self) -> bool:
        """Whether SIGINT comes to this handler now: then no ``KeyboardInterrupt`` comes from
        Ctrl-C, and one that reaches the run was raised by code."""
        return signal.getsignal(signal.SIGINT) == self._on_signal

    def requested(self, step: int) -> bool:
        """Whether the run must stop after ``step`` (the same answer on every host; with
        several, JAX's sync point is asked once per step)."""
        if self.shared is None:
            self.shared = jax.process_count() > 1
        if not self.shared:
            return self.signal_name is not None
        if self.asked[0] != step:
            try:
                self.asked = (step, multihost_utils.reached_preemption_sync_point(step))
            except RuntimeError as err:  # the preemption service is off: each host for itself
                self.shared = False
                self.err.write(f"warning: hosts cannot agree on a preemption step ({err}); "
                               "each stops on its own signal\n")
                return self.signal_name is not None
        return self.asked[1]

    @property
    def reason(self) -> str:
        return self.signal_name or "a preemption notice"

    # As a hook: asked after every call (every host at the same steps), it stops the run at
    # that call's boundary; the checkpoint hook after it saves that step. At the run's end it
    # just finishes.
    every_boundary = False

    def poll(self, step: int) -> bool:
        return self.requested(step)

    def at_boundary(self, boundary: Any) -> None:
        if self.requested(boundary.step) and boundary.step < boundary.total:
            boundary.stop(f"preempted ({self.reason})", preempted=True)


def _has_fd(stream: TextIO) -> bool:
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    return True
