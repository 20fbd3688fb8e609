"""The user's code that a run calls (rewards, callbacks, a model's functions, data iterators),
and what it raised: any exception, ``SystemExit`` and ``KeyboardInterrupt`` included, ends the
run as failed with one line naming the function (``errors.UserCodeFailed``, exit 1). A reward
that calls ``sys.exit(0)`` never ends a run as if it had finished.

The function is found in the traceback: below the last frame of trainrun, the first frame of
code that is neither trainrun's nor the standard library's nor an installed package's. That is
the function trainrun called, directly or through JAX or Grain; the trainrun module that called
it says what it is (a reward, a callback, ...). An error raised in trainrun's own code stays
trainrun's and keeps its traceback, and a ``UserError`` keeps its own line, whoever raised it.

A run handles SIGINT itself (``preemption.py``: the first saves a checkpoint and stops, a second
aborts), so a ``KeyboardInterrupt`` that reaches the run while that handler is in place was
raised by code, not by Ctrl-C.
"""

from __future__ import annotations

import site
import sysconfig
import traceback
from pathlib import Path
from types import FrameType

from trainrun.errors import UserError

_TRAINRUN = Path(__file__).resolve().parents[1]
# Where the standard library and installed packages live: their frames are nobody's function.
_LIBRARIES = tuple({Path(p).resolve() for p in (
    *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    *site.getsitepackages(), site.getusersitepackages())})
# The trainrun module that called the user's function -> what the function is to the run.
_ROLES = {"data/rewards.py": "reward", "training/callbacks.py": "callback",
          "training/checkpoint_hook.py": "callback", "models/adapters.py": "model function",
          "program/batch_source.py": "data iterator"}


def raised_by_user(err: BaseException, interrupts_handled: bool) -> str | None:
    """What the failure's line starts with when ``err`` was raised by the user's code, e.g.
    ``callback Stop.at_boundary (stop.py:12) raised SystemExit(0)``; None for trainrun's own
    errors and ``UserError``. ``SystemExit``, ``KeyboardInterrupt`` and the other exits are
    always named (where they were raised), as a ``KeyboardInterrupt`` is unless
    ``interrupts_handled`` is False (then it may be Ctrl-C)."""
    if isinstance(err, UserError) or (isinstance(err, KeyboardInterrupt)
                                      and not interrupts_handled):
        return None
    frames = list(traceback.walk_tb(err.__traceback__))
    kinds = [_kind(frame) for frame, _ in frames]
    last = max((i for i, kind in enumerate(kinds) if kind == "trainrun"), default=-1)
    users = [i for i in range(last + 1, len(frames)) if kinds[i] == "user"]
    if not users:  # none of the user's frames: trainrun's error, or an exit raised elsewhere
        if isinstance(err, Exception) or not frames:
            return None
        users = [len(frames) - 1]
    called, deepest = users[0], users[-1]
    role = _ROLES.get(_relative(frames[last][0]), "function") if 0 <= last < called else (
        "function")
    line = f"{role} {_named(*frames[called])} raised {_described(err)}"
    if deepest != called:  # where in the user's code, below the function trainrun called
        line += f" in {_named(*frames[deepest])}"
    return line


def _kind(frame: FrameType) -> str:
    """``trainrun``, ``library`` (the standard library, an installed package) or ``user``."""
    name = frame.f_code.co_filename
    if name.startswith("<"):  # "<string>" is a user's `python -c`; "<frozen ...>" Python's
        return "library" if name.startswith("<frozen") else "user"
    path = Path(name).resolve()
    if path.is_relative_to(_TRAINRUN):
        return "trainrun"
    return "library" if any(path.is_relative_to(lib) for lib in _LIBRARIES) else "user"


def _relative(frame: FrameType) -> str:
    return Path(frame.f_code.co_filename).resolve().relative_to(_TRAINRUN).as_posix()


def _named(frame: FrameType, line: int) -> str:
    """``qualified.name (file:line)``; a module's own code as ``module NAME``."""
    code = frame.f_code
    name = code.co_qualname
    if name == "<module>":
        name = f"module {Path(code.co_filename).stem}"
    return f"{name} ({code.co_filename}:{line})"


def _described(err: BaseException) -> str:
    """The exception as Python writes it (``SystemExit(0)``, ``KeyboardInterrupt()``), on one
    line and at most 200 characters."""
    text = " ".join(repr(err).split())
    return text if len(text) <= 200 else text[:199] + "…"
