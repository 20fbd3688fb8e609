"""A call within a time limit: interrupted in the main thread (a sleep, a function that catches
the first interruption), its SIGALRM handler in place for the call alone, the signals the
function asks for itself left to it, and a call stuck in C code ended by the process."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from trainrun.platform.time_limit import TimedOut, call_within


def test_a_call_that_returns_in_time_gives_its_value_and_leaves_no_handler() -> None:
    before = signal.getsignal(signal.SIGALRM)
    assert call_within(30.0, lambda: 7) == 7
    assert call_within(None, lambda: 8) == 8
    assert signal.getsignal(signal.SIGALRM) is before


def test_a_sleeping_call_is_interrupted() -> None:
    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(TimedOut):
        call_within(0.5, lambda: time.sleep(1000))
    assert signal.getsignal(signal.SIGALRM) is before


def test_a_call_that_catches_the_interruption_and_goes_on_is_interrupted_again() -> None:
    caught: list[str] = []

    def stubborn() -> None:
        try:
            time.sleep(1000)
        except BaseException as error:  # what a careless function does
            caught.append(type(error).__name__)
        time.sleep(1000)

    with pytest.raises(TimedOut):
        call_within(1.0, stubborn)
    assert caught == ["TimedOut"]


def test_the_functions_own_alarm_is_its_own_and_the_limit_still_holds() -> None:
    """As math_verify limits its parsing: its own SIGALRM handler and ``signal.alarm``, which
    it cancels after (the process's one interval timer): its alarm reaches its handler, and the
    call's limit holds after it."""

    class Own(Exception):
        pass

    def raise_own(signum: int, frame: object) -> None:
        raise Own

    got: list[str] = []

    def own_alarm_then_hang() -> None:
        previous = signal.signal(signal.SIGALRM, raise_own)
        signal.alarm(1)
        try:
            time.sleep(1000)
        except Own:
            got.append("own")
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        time.sleep(1000)

    with pytest.raises(TimedOut):
        call_within(2.0, own_alarm_then_hang)
    assert got == ["own"]


@pytest.mark.slow
def test_a_call_stuck_in_c_code_ends_the_process(tmp_path) -> None:
    """A runaway regular expression never returns to the interpreter: no handler runs, and
    faulthandler ends the process with exit code 1 and where it stood."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import re\nfrom trainrun.platform.time_limit import call_within\n"
        f"call_within(0.5, lambda: re.match({r'(a+)+$'!r}, 'a' * 60 + 'b'))\n"
        "print('returned')\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "returned" not in result.stdout
    assert re.search(r"^Timeout \(", result.stderr, flags=re.M), result.stderr
    assert "stuck.py" in result.stderr  # the stack names the call
