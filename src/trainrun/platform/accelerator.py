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


def held_device_line(message: str, environ: dict[str, str] | None = None) -> str | None:
    """JAX's error at backend start, where it says another process holds the TPU, as one line
    naming that process (its pid and command) and ``JAX_PLATFORMS``; None for any other
    error."""
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS")
    asked = f"JAX_PLATFORMS={platforms}" if platforms else "JAX_PLATFORMS unset"
    fix = "stop it, or run on the CPU with JAX_PLATFORMS=cpu"
    found = HELD_BY.search(message)
    if found:
        pid = int(found.group(1))
        return (f"the TPU is held by process {pid} ({_command(pid)}; {asked}): one process at "
                f"a time can hold it; {fix}")
    if HELD_BY_SOMEONE.search(message):
        return ("the TPU is held by another process, probably another user's (`sudo lsof -w "
                f"/dev/accel0` names it; {asked}): one process at a time can hold it; {fix}")
    return None


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
