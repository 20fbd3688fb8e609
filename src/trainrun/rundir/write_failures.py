"""When the file system refuses a write: a full disk, a read-only or forbidden folder, a quota.

The run stops with one line that names the file and the last committed checkpoint (what a
resume starts from), exit 1. Before that line, what the failed write left half done is removed:
temporary files (``*.tmp``) and the step directory of a save that never committed. The files a
run appends to never hold half a record (``sinks.jsonl.JsonlWriter`` cuts a refused write back to
its last whole line), and every other file is replaced by a rename, so the run directory is as
the last good moment left it and the same command resumes it once the disk has room.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainrun.errors import OutOfMemory, ReadFailed, UserCodeFailed, WriteFailed
from trainrun.rundir.checkpoint_steps import committed_steps, uncommitted_steps
from trainrun.rundir.layout import ORBAX_TMP
from trainrun.rundir.run_directory import RunDirectory
from trainrun.rundir.status import mark_failed, resume_point
from trainrun.storage.atomic import TMP_SUFFIX
from trainrun.storage.location import Location

# errno -> how the line says it (strerror's wording, lower case)
REFUSED = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "file too large",
}
# TensorStore and Orbax's threads report the OS error inside their own exception's text.
_TEXT = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
         "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES}
# A quoted absolute path on one line: the text can hold a whole traceback, whose quotes around
# other lines must not make a "path" of several lines (the report is one line).
_PATH = re.compile(r"""["'](/[^"'\n]+)["']""")


def refused_write(err: BaseException) -> tuple[str, str | None] | None:
    """``(what happened, the file)`` when ``err``, or an error that led to it, is a write the
    file system refused; else None."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]  # an error's cause and context may be None
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or isinstance(e, ReadFailed):  # a read, said as one
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REFUSED:
            return REFUSED[e.errno], e.filename and str(e.filename)
        text = str(e)
        for phrase, code in _TEXT.items():
            if phrase in text:
                found = _PATH.search(text)
                return REFUSED[code], found.group(1) if found else None
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def remove_partial(run_dir: Path, ckpt_dir: Location) -> None:
    """Temporary files and uncommitted step directories: what a refused write left behind.
    Only the process holding the run directory's lock calls this, so none is another's."""
    for path in (run_dir.glob(f"*{TMP_SUFFIX}") if run_dir.is_dir() else ()):
        with contextlib.suppress(OSError):
            path.unlink()
    local = ckpt_dir.local_path
    if local is None:  # a step without its commit file: Orbax removes it at the next start
        return
    for path in (local.glob(f"*{ORBAX_TMP}*") if local.is_dir() else ()):
        shutil.rmtree(path, ignore_errors=True)


def failure_line(what: str, file: str | None, run_dir: Location, ckpt_dir: Location) -> str:
    """The one line: what was refused, where, and what a resume starts from."""
    if file is None:  # Orbax's threads do not say which file: name the save in flight
        local = ckpt_dir.local_path
        partial = (uncommitted_steps(ckpt_dir) if local is None else
                   [p.name.split(".")[0] for p in sorted(local.glob(f"*{ORBAX_TMP}*"))]
                   if local.is_dir() else [])
        file = (f"the checkpoint of step {partial[0]} ({ckpt_dir})" if partial
                else f"in {run_dir}")
    steps = committed_steps(ckpt_dir)
    last = (f"the last committed checkpoint is step {steps[-1]} (the same command resumes "
            "from it once the write can succeed)" if steps else "no checkpoint was committed")
    return f"{what} writing {file}; {last}"


# What an abandoned save's tasks raise once the loop or the executor they ran on is gone.
_ECHOES = ("cannot schedule new futures after shutdown", "Event loop is closed")


class QuietRefusedWrites(logging.Filter):
    """Drops the records Orbax's background threads log, with a traceback each, for a write
    the file system refused: the run reports that itself, on one line. With ``echoes``, also
    the errors of that save's other tasks, which find its loop or executor shut down."""

    def __init__(self, echoes: bool = False) -> None:
        super().__init__()
        self.echoes = echoes

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        if refused_write(error) is not None:
            return False
        return not (self.echoes and isinstance(error, RuntimeError) and str(error) in _ECHOES)


_ASYNCIO_QUIET = QuietRefusedWrites()
_AFTER_REFUSED = QuietRefusedWrites(echoes=True)
_after_refused_hook: Callable[[Any], None] | None = None


def _drop_closed_loop_reports(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable hook that drops asyncio's "Event loop is closed" and hands on the rest."""

    def hook(unraisable: Any) -> None:
        if not (isinstance(unraisable.exc_value, RuntimeError)
                and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    return hook


def quiet_after_refused_write() -> None:
    """From the moment a refused write is reported until the process ends: Orbax's threads
    and asyncio's collected tasks go on reporting the abandoned save, and its echoes, after
    the checkpoint directory is closed (seen at exit, after the one line). The line says it."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _AFTER_REFUSED not in logger.filters:
            logger.addFilter(_AFTER_REFUSED)
    global _after_refused_hook
    if sys.unraisablehook is not _after_refused_hook:
        _after_refused_hook = _drop_closed_loop_reports(sys.unraisablehook)
        sys.unraisablehook = _after_refused_hook
    # The coroutines of the write TensorStore abandoned are never awaited; Python warns of
    # each when it is collected.
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited",
                            category=RuntimeWarning)


def quiet_orbax_errors() -> Callable[[], None]:
    """While a checkpoint directory is open: the filter above on absl's logger (Orbax logs
    through it), and no report of the callbacks TensorStore still makes, after a failed read
    or write, into the asyncio loop Orbax has already closed ("Event loop is closed"). Returns
    what undoes both."""
    quiet = QuietRefusedWrites()
    logging.getLogger("absl").addFilter(quiet)
    # asyncio reports a refused write's never-retrieved future when it is collected, which can
    # be after the directory is closed (at exit): that filter stays.
    logging.getLogger("asyncio").addFilter(_ASYNCIO_QUIET)
    previous = sys.unraisablehook
    hook = _drop_closed_loop_reports(previous)
    sys.unraisablehook = hook

    def undo() -> None:
        logging.getLogger("absl").removeFilter(quiet)
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous

    return undo


def out_of_memory(err: BaseException) -> bool:
    """A host allocation that failed (``MemoryError``) or a device one (XLA's
    ``RESOURCE_EXHAUSTED``)."""
    return isinstance(err, MemoryError) or (
        type(err).__name__ in ("XlaRuntimeError", "JaxRuntimeError")
        and "RESOURCE_EXHAUSTED" in str(err))


def on_failure(err: BaseException, directory: RunDirectory,
               raised_by_user: str | None = None) -> Exception | None:
    """Record a run that raised as ``failed`` with the reason. A refused write becomes the
    one-line ``WriteFailed`` (returned), after what it left half written is removed (one
    raised as ``WriteFailed`` keeps its own line); an allocation that failed, the one-line
    ``OutOfMemory``; an error of the user's code (``raised_by_user``: the line's start, naming
    the function), the one-line ``UserCodeFailed``."""
    if out_of_memory(err):
        steps = committed_steps(directory.ckpt_dir)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        last = (f"the last committed checkpoint is step {steps[-1]}" if steps
                else "no checkpoint was committed")
        line = (f"out of memory ({first}); {last}; lower data.batch_size or steps_per_call, "
                "set model.remat, accumulate, or compute in bfloat16 (precision.compute)")
        mark_failed(directory.run_dir, line, directory.ckpt_dir)
        return OutOfMemory(line)
    if isinstance(err, WriteFailed):  # its own line already, naming its place (the data cache)
        line = str(err)
    else:
        refused = refused_write(err)
        if refused is None:
            return _failed(err, directory, raised_by_user)
        line = failure_line(*refused, directory.run_dir, directory.ckpt_dir)  # before removal
    quiet_after_refused_write()
    if directory.locks:  # this process holds the folders: what is half written is its own
        remove_partial(directory.run_dir, directory.ckpt_dir)
    step = getattr(err, "step", None)  # known to a run that lost its store: not asked of it
    mark_failed(directory.run_dir, line, None if step is not None else directory.ckpt_dir,
                step=step)
    return err if isinstance(err, WriteFailed) else WriteFailed(line)


def _failed(err: BaseException, directory: RunDirectory,
            raised_by_user: str | None) -> Exception | None:
    """Any other failure: the user's code's as ``UserCodeFailed`` (returned), ending with
    where a resume starts; trainrun's own recorded as its type and text (None: raised as
    it is)."""
    if raised_by_user is None:
        mark_failed(directory.run_dir,
                    " ".join(f"{type(err).__name__}: {err}".split())[:300], directory.ckpt_dir)
        return None
    line = f"{raised_by_user}; {resume_point(directory.ckpt_dir, ' once the code is fixed')}"
    mark_failed(directory.run_dir, line, directory.ckpt_dir)
    return UserCodeFailed(line)
