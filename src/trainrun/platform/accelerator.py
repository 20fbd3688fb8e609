"""The accelerator this machine's JAX processes start on, as much as trainrun must know of it
before JAX's backend starts, and when its start fails.

A TPU chip is held by one process at a time: libtpu locks it when a process's backend starts
and keeps it locked until that process exits; a second process fails at its backend start ("The
TPU is already in use by process with pid N"). So a command that starts processes of its own
(``verify-resume``, ``launch``) asks ``one_process_device`` without starting its own backend,
which would take the chip from the processes it starts (``start_here_on_cpu``), and a backend
start refused for a chip another process holds is said in one line (``held_device_line``).
GPUs are shared by processes (each takes its own share of memory): none of this applies there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax

from trainrun.errors import printable

TPU = "TPU"
# libtpu's refusals at backend start: the holder found by its pid, or not (another user's)
HELD_BY = re.compile(r"TPU is already in use by process with pid (\d+)")
HELD_BY_SOMEONE = re.compile(r"TPU is already in use by another process")
HELD_LOCKFILE = re.compile(r"Internal error when accessing libtpu multi-process lockfile")
LIBTPU_LOCKFILE = Path("/tmp/libtpu_lockfile")  # libtpu locks it with lockf while it holds
PROC = Path("/proc")
COMMAND_SHOWN = 80  # characters of the holder's command line a refusal shows


def one_process_device(platforms: str | None = None, tpu_host: bool | None = None,
                       ) -> str | None:
    """The device JAX would start here that one process at a time holds ("TPU"), or None,
    found without starting JAX's backend.

    platforms: JAX's ``jax_platforms`` (default: its value now; importing JAX on a TPU host
        sets it to ``tpu,cpu`` where the user has not). tpu_host: whether importing JAX found
        TPU chips and libtpu (default: what it found).
    """
    if platforms is None:
        platforms = jax.config.values["jax_platforms"]
    if tpu_host is None:
        from jax._src import cloud_tpu_init  # what JAX's import found: no public way to ask

        tpu_host = cloud_tpu_init.running_in_cloud_tpu_vm
    if not tpu_host:
        return None
    if platforms and "tpu" not in [p.strip() for p in platforms.split(",")]:
        return None  # JAX_PLATFORMS=cpu, say: this process would not touch the chip
    return TPU


def start_here_on_cpu() -> str | None:
    """For a process that starts others which need the device: where one process at a time
    holds it (``one_process_device``), this process's JAX starts on the CPU (for reading
    checkpoints), leaving the device to them. Returns that device, or None where nothing
    changed. The processes it starts keep the environment's platforms: the setting is this
    process's only, not an environment variable."""
    held = one_process_device()
    if held is None:
        return None
    from jax._src import xla_bridge  # no public way to ask whether the backend started

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
    return held


def held_device_line(message: str, environ: dict[str, str] | None = None,
                     lockfile: Path | None = None) -> str | None:
    """JAX's error at backend start, where it says another process holds the TPU, as one line
    naming that process (its pid and command) and ``JAX_PLATFORMS``; None for any other
    error. lockfile: libtpu's (default ``LIBTPU_LOCKFILE``), whose locker is the holder where
    libtpu's words name none."""
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS")
    asked = f"JAX_PLATFORMS={platforms}" if platforms else "JAX_PLATFORMS unset"
    fix = "stop it, or run on the CPU with JAX_PLATFORMS=cpu"
    found = HELD_BY.search(message)
    pid = int(found.group(1)) if found else None
    if pid is None and HELD_LOCKFILE.search(message):
        locked = LIBTPU_LOCKFILE if lockfile is None else lockfile
        pid = lockfile_holder(locked)
        if pid is None:  # not this user's, or not in this PID namespace: never remove its lock
            return ("the TPU is held by another process, which this user cannot see (it holds "
                    f"libtpu's lockfile {locked} locked; `sudo lsof -w {locked}` names it; "
                    f"{asked}): one process at a time can hold it; {fix}")
    if pid is not None:
        return (f"the TPU is held by process {pid} ({_command(pid)}; {asked}): one process at "
                f"a time can hold it; {fix}")
    if HELD_BY_SOMEONE.search(message):
        return ("the TPU is held by another process, probably another user's (`sudo lsof -w "
                f"/dev/accel0` names it; {asked}): one process at a time can hold it; {fix}")
    return None


def lockfile_holder(path: Path, proc: Path = PROC) -> int | None:
    """The process, other than this one, that holds ``path`` locked: the POSIX or flock lock
    on its device and inode in ``/proc/locks``, else the earliest started of the processes
    with it open (``/proc/PID/fd``; libtpu keeps its lockfile open while it holds the chip);
    None where neither names one (another user's process, another PID namespace)."""
    try:
        found = path.stat()
    except OSError:
        return None
    return _locker(found, proc / "locks") or _opener(path, proc)


def _locker(found: os.stat_result, locks: Path) -> int | None:
    """The pid of the granted lock on ``found``'s file in ``locks`` (lines such as ``1: POSIX
    ADVISORY WRITE 1353 00:2b:41 0 EOF``, device numbers in hex; a waiter's has ``->``)."""
    try:
        lines = locks.read_text().splitlines()
    except OSError:
        return None
    file = (os.major(found.st_dev), os.minor(found.st_dev), found.st_ino)
    for line in lines:
        words = line.split()
        if len(words) < 6 or words[1] == "->":
            continue
        try:
            major, minor, inode = words[5].split(":")
            lock = (int(major, 16), int(minor, 16), int(inode))
            pid = int(words[4])
        except ValueError:
            continue
        if lock == file and pid > 0 and pid != os.getpid():
            return pid
    return None


def _opener(path: Path, proc: Path) -> int | None:
    """The earliest started process, other than this one, with ``path`` among its open files
    (its ``fd`` links); only processes this user may look into are seen."""
    target = os.path.realpath(path)
    openers = []
    for fds in proc.glob("[0-9]*/fd"):
        pid = int(fds.parent.name)
        if pid == os.getpid():  # a refused start leaves libtpu's lockfile open here too
            continue
        try:
            if any(os.readlink(fd) == target for fd in fds.iterdir()):
                openers.append(pid)
        except OSError:  # another user's process, or one that ended meanwhile
            continue
    return min(openers, key=lambda pid: (_started(proc / str(pid)), pid), default=None)


def _started(process: Path) -> int:
    """When a process started, in clock ticks after boot (``stat``'s 22nd field)."""
    try:
        stat = (process / "stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _command(pid: int) -> str:
    """A process's command line as ``ps`` shows it, shortened; or why it cannot be read."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "its command cannot be read here"
    command = " ".join(w.decode(errors="replace") for w in words if w)
    if not command:
        return "its command cannot be read here"
    if len(command) > COMMAND_SHOWN:
        command = command[:COMMAND_SHOWN - 3] + "..."
    return printable(command)
