"""The XLA flags and process settings trainrun sets by default: here and nowhere else, each with
its measured effect.

XLA reads ``XLA_FLAGS`` once, when JAX starts its backend (the first computation or device
query). ``import trainrun`` adds these flags to the environment, which is before that in any
program that imports trainrun before computing; child processes (the CLI, the multi-process
launcher) inherit them. A flag already named in ``XLA_FLAGS`` is left as the user set it, and
every run records the ``XLA_FLAGS`` it ran with in its provenance.

``--xla_cpu_experimental_ynn_fusion_type=`` (empty: no YNNPACK fusions on CPU)
    jaxlib 0.10's XLA:CPU hands dots, with the elementwise ops and reductions around them, to
    YNNPACK, and fuses them differently in a one-step program and in a K-step scan: with its
    fusions on, the byte LM's losses at ``steps_per_call`` 2 and 1 differ in their last bits
    (``tests/test_eval.py`` fails), with them off they are bitwise equal, as trainrun promises.
    Speed (BENCHMARKS.md, "The byte LM against PyTorch on CPU", ablation): once the transformer
    ran its matmuls on 2-D operands, the fusions stopped mattering (0.349 vs 0.357 s a step,
    inside the noise); before that, turning them off saved 10-20% of the LM's step, because
    YNNPACK wrote broadcasts (a layer norm's scale, a softmax's normalizer) out in full. The
    flag changes the rounding of CPU matmuls, so runs differ in their last bits from runs
    without it; a program that imports trainrun before it computes has it on both sides of any
    comparison.

And one setting of glibc's allocator, for the same reason and at the same time
(``reuse_freed_memory``): XLA:CPU allocates each call's temporary buffers as one block (493 MB
for the byte LM's step) from an XLA thread. glibc serves a block that large from a fresh
``mmap`` and unmaps it when the call ends, so every call faults in and zeroes every page again:
120,000 page faults per step. With every thread on the main arena (``M_ARENA_MAX`` 1), no
``mmap`` for large blocks and no trimming below 2 GB, the block is reused from call to call:
a few thousand faults per step, and the step took 0.38 s instead of 0.68 s (measured with
``benchmarks/lm_vs_torch.py``; without the arena limit the faults stay at 120,000). The one
arena is also why small steps need the dispatch setting below. It does not change any result.
It is set only on glibc Linux, only in a process without a GPU plugin, and not when the user
set glibc's malloc through ``MALLOC_*`` or ``GLIBC_TUNABLES`` variables. The cost: freed
memory stays with the process.

And one JAX setting (``run_cpu_calls_inline``): ``jax_cpu_enable_async_dispatch`` off, so a
single-device XLA:CPU call runs in the thread that makes it instead of being handed to an XLA
thread. The hand-off is what a small step pays for: with it, the chapter's MLP loop took
25-70 µs a step from one process to the next on this 2-core machine (depending on where the
two threads landed), and 50-60 µs with the allocator setting above, whose single arena the
two threads then share; inline it takes 34-36 µs in every process. Large steps do not notice
(the byte LM: 0.39 s either way), and calls over several devices stay asynchronous. What it
gives up: the host no longer prepares the next call while a one-device call runs. To keep
asynchronous dispatch, call ``jax.config.update("jax_cpu_enable_async_dispatch", True)`` after
importing trainrun, before the first computation.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pkgutil
import platform
import sys
from collections.abc import Mapping, MutableMapping
from importlib import metadata

import jax

# flag -> value. Only for jaxlib releases whose XLA knows the flag: XLA aborts the process at
# backend start on a flag it does not know.
DEFAULT_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}
KNOWN_JAXLIB = ("0.10.",)


def apply_default_flags(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Add the default flags the user has not set to ``XLA_FLAGS``; returns those added."""
    try:
        jaxlib = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return []
    if not jaxlib.startswith(KNOWN_JAXLIB):
        return []
    flags = environ.get("XLA_FLAGS", "")
    added = [f"{name}={value}" for name, value in DEFAULT_FLAGS.items()
             if name.lstrip("-") not in flags]
    if added:
        environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added


# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def reuse_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Make glibc keep and reuse large freed blocks (see the module docstring). Call before
    JAX starts its backend threads. Returns whether the allocator was set."""
    chosen = any(name.startswith("MALLOC_") for name in environ) or "malloc" in environ.get(
        "GLIBC_TUNABLES", "")
    if (chosen or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"
            or _accelerator_plugin()):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))


def _accelerator_plugin() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:
        return importlib.util.find_spec("libtpu") is not None
    import jax_plugins

    return any(pkgutil.iter_modules(jax_plugins.__path__))


def run_cpu_calls_inline() -> bool:
    """Turn XLA:CPU's asynchronous dispatch off (see the module docstring) if JAX's backend has
    not started yet (the setting is read when it starts). Returns whether it was set."""
    from jax._src import xla_bridge  # no public way to ask whether the backend started

    if xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True
