"""A call that must return within a time limit (``call_within``): a user's function that hangs
(a reward waiting on a server that never answers) ends the run instead of holding it forever.

The call runs in the calling thread, as it would without a limit: a reward runs where TRL runs
it, in the main thread, so code that uses signals itself (``math_verify``'s own time limits)
works unchanged. At the limit a watchdog thread sends SIGALRM to the main thread, whose handler,
installed for the call alone, raises ``TimedOut`` there: a sleep, a wait on a socket or a lock,
and Python code all end with it. The watchdog sends it again each second (more often under a
short limit) until the call is over, since the code interrupted may have caught it or put a
handler of its own in place; a call that returns past the limit counts as timed out all the
same. It never touches the process's interval timer, which the code called may set and cancel
(``signal.alarm``).

Code that never returns to the interpreter (a C extension that holds it: a runaway regular
expression) cannot be interrupted from Python. ``faulthandler`` ends such a process: as long
again after the limit (at most ``BACKSTOP`` seconds more) it writes each thread's stack to
stderr and exits 1 (faulthandler keeps one such timer a process: one set before the call is
cancelled). Off the main thread (a run started from another thread) Python delivers no signal
to the call, and that is the only stop.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
BACKSTOP = 30.0  # the most seconds past the limit before faulthandler ends the process
_AGAIN = 1.0  # the most seconds between the watchdog's interruptions of a call that goes on


class TimedOut(BaseException):
    """Raised in a call that ran past its limit. Not an ``Exception``: the function's own
    ``except Exception`` lets it through."""


def call_within(seconds: float | None, function: Callable[[], T]) -> T:
    """``function()``; ``TimedOut`` once it has run ``seconds`` without returning (None: no
    limit). See the module docstring for how the call is stopped."""
    if seconds is None:
        return function()
    watchdog = _Watchdog(seconds)
    watchdog.start()
    try:
        value = function()
    finally:
        watchdog.stop()
    if watchdog.fired:
        raise TimedOut(seconds)
    return value


class _Watchdog:
    """The limit of one call: the watchdog thread, the handler and the backstop."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.fired = False  # the limit passed while the call ran
        self.finished = False  # the call is over: the handler raises no more
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="trainrun-time-limit",
                                       daemon=True)
        self.main = threading.current_thread() is threading.main_thread()
        self.previous: Any = signal.getsignal(signal.SIGALRM) if self.main else None
        # a handler set outside Python cannot be put back: the call then has the backstop alone
        self.interrupts = self.main and self.previous is not None

    def start(self) -> None:
        if self.interrupts:
            signal.signal(signal.SIGALRM, self._interrupt)
        faulthandler.dump_traceback_later(self.seconds + min(self.seconds, BACKSTOP),
                                          exit=True, file=2)
        self.thread.start()

    def stop(self) -> None:
        """The watchdog stopped and the handler put back, even if an interruption lands while
        this runs (it counts: ``fired`` says so)."""
        while True:
            try:
                self.finished = True
                self.done.set()
                self.thread.join()
                break
            except TimedOut:
                continue
        faulthandler.cancel_dump_traceback_later()
        if self.interrupts:
            signal.signal(signal.SIGALRM, self.previous)

    def _watch(self) -> None:
        if self.done.wait(self.seconds):
            return
        self.fired = True
        main = threading.main_thread().ident
        while self.interrupts and main is not None:
            signal.pthread_kill(main, signal.SIGALRM)
            # a few before the backstop even when the limit is short
            if self.done.wait(min(_AGAIN, self.seconds / 4)):
                return

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self.fired and not self.finished:
            raise TimedOut(self.seconds)
        if callable(self.previous):  # a SIGALRM the call's own code asked for
            self.previous(signum, frame)
