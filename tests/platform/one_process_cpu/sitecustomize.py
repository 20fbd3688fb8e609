"""A CPU that behaves as a TPU host's chip, for a process that imports this at its start (a
folder holding it first on ``PYTHONPATH``): JAX's import is told it found TPU chips and libtpu,
and its backend, unless the process asks for the CPU alone (``jax_platforms`` "cpu", as
``JAX_PLATFORMS=cpu`` on a TPU host), takes an exclusive lock on the file ``$DEVICE_LOCK`` at
start, held until the process exits, and refuses with libtpu's own words while another process
holds it. ``$DEVICE_START_S``: seconds the start takes, as a TPU runtime's does.
``$DEVICE_REFUSAL=lockfile``: the refusal is libtpu's where it cannot find the holder ("Internal
error when accessing libtpu multi-process lockfile"), and ``$DEVICE_LOCK`` stands for its
lockfile, ``/tmp/libtpu_lockfile``, in trainrun's accelerator module once that is imported."""

import fcntl
import os
import sys
import time
from pathlib import Path

import jax
from jax._src import cloud_tpu_init, xla_bridge

cloud_tpu_init.running_in_cloud_tpu_vm = True
cpu = xla_bridge._backend_factories["cpu"]


def held_cpu():
    if jax.config.values["jax_platforms"] == "cpu":  # the host's CPU: no chip touched
        return cpu.factory()
    fd = os.open(os.environ["DEVICE_LOCK"], os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # fd stays open, as libtpu leaves its lockfile open after a refusal
        if os.environ.get("DEVICE_REFUSAL") == "lockfile":
            accelerator = sys.modules.get("trainrun.platform.accelerator")
            if accelerator is not None:
                accelerator.LIBTPU_LOCKFILE = Path(os.environ["DEVICE_LOCK"])
            raise RuntimeError("ABORTED: Internal error when accessing libtpu multi-process "
                               'lockfile. Run "$ sudo rm /tmp/libtpu_lockfile".') from None
        holder = os.pread(fd, 32, 0).decode().strip()
        raise RuntimeError(f"ABORTED: The TPU is already in use by process with pid {holder}. "
                           "Not attempting to load libtpu.so in this process.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    time.sleep(float(os.environ.get("DEVICE_START_S", "0")))
    return cpu.factory()  # fd stays open: the lock is held until the process exits


xla_bridge.register_backend_factory("cpu", held_cpu, priority=0, fail_quietly=False)
