"""Every process-wide setting trainrun makes (XLA flags, glibc's allocator, JAX's CPU dispatch):
here and nowhere else, each with its measured effect, and when each is made.

    import trainrun          only ``apply_default_flags``: the flags a promise needs before JAX's
                             backend starts (the K-invariance flag below; GPU determinism where a
                             GPU plugin is installed). Nothing else in the process changes.
    trainrun train / run()   ``configure_process``: the flags, the allocator and the dispatch
                             setting, if JAX's backend has not started yet (else a one-line
                             notice, and the run goes on without them).
    a library user           ``trainrun.configure_process()`` before the first computation.

XLA reads ``XLA_FLAGS`` once, when JAX starts its backend (the first computation or device
query); child processes (the CLI, the multi-process launcher) inherit them. A flag already named
in ``XLA_FLAGS`` is left as the user set it, and every run records the ``XLA_FLAGS`` it ran with
in its provenance.

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

And one setting of glibc's allocator (``reuse_freed_memory``), by ``configure_process``: XLA:CPU
allocates each call's temporary buffers as one block (493 MB for the byte LM's step) from an XLA
thread. glibc serves a block that large from a fresh
``mmap`` and unmaps it when the call ends, so every call faults in and zeroes every page again:
120,000 page faults per step. With every thread on the main arena (``M_ARENA_MAX`` 1), no
``mmap`` for large blocks and no trimming below 2 GB, the block is reused from call to call:
a few thousand faults per step, and the step took 0.38 s instead of 0.68 s (measured with
``benchmarks/lm_vs_torch.py``; without the arena limit the faults stay at 120,000). The one
arena is also why small steps need the dispatch setting below. It does not change any result.
It is set only on glibc Linux, only in a process without a GPU plugin, and not when the user
set glibc's malloc through ``MALLOC_*`` or ``GLIBC_TUNABLES`` variables. The cost: freed
memory stays with the process.

And one JAX setting (``run_cpu_calls_inline``), by ``configure_process``:
``jax_cpu_enable_async_dispatch`` off, so a single-device XLA:CPU call runs in the thread that
makes it instead of being handed to an XLA thread. The hand-off is what a small step pays for:
with it, the chapter's MLP loop took 25-70 µs a step from one process to the next on this 2-core
machine (depending on where the two threads landed), and 50-60 µs with the allocator setting
above, whose single arena the two threads then share; inline it takes 34-36 µs in every process.
Large steps do not notice (the byte LM: 0.39 s either way), and calls over several devices stay
asynchronous. What it gives up: the host no longer prepares the next call while a one-device
call runs. To keep asynchronous dispatch, call
``trainrun.configure_process(inline_cpu_calls=False)``.

And, in a process where JAX has a GPU plugin (CUDA or ROCm), XLA:GPU's deterministic mode, for
trainrun's promise that a resumed run computes the same bits as an uninterrupted one (and two
fresh runs of a config the same bits as each other). Without it, two fresh processes training
the LM with dropout on an H200 differed from step 2 (grad norm 5.572762489 vs 5.572762012):
the autotuner picks GEMM kernels by timing, so the two processes run different kernels, and an
embedding gradient is a scatter-add that XLA:GPU does with atomics. The flags
(``GPU_DETERMINISM_FLAGS``, each what XLA's source says it does):

``--xla_gpu_deterministic_ops=true``
    Through ``RequireDeterminism`` (``xla/service/gpu/stream_executor_util.cc``, true with it or
    with ``--xla_gpu_exclude_nondeterministic_ops``): the autotuner takes the first config that
    compiles instead of the fastest it timed (``select_first_config`` in
    ``xla/service/gpu/autotuning/autotuner_pass.cc``); scatters are rewritten deterministic
    (``xla/service/gpu/gpu_compiler.cc``); cuDNN's fused attention runs its backward pass with
    its deterministic algorithm (``force_deterministic`` in
    ``xla/service/gpu/transforms/cudnn_custom_call_compiler.cc``: without it the query
    gradient is accumulated with atomics). Reductions are not among the operations XLA names
    as non-deterministic on GPUs (scatter, select-and-scatter, GEMMs, convolutions, attention:
    ``docs/determinism.md``).
``--xla_gpu_enable_triton_gemm=false``
    Deterministic mode also drops the Triton backend from the autotuner (``autotuner_pass.cc``),
    while the GEMM fusion pass still makes Triton GEMM fusions (it runs whenever this flag is
    on, ``gpu_compiler.cc``). On jaxlib 0.11 with CUDA 13 no backend left could take such a
    fusion: compiling the LM's step died with "No supported config found for HLO
    %gemm_fusion_dot... BlasLt is unavailable" (no config compiled, ``ConfigAssigner`` in
    ``xla/backends/autotuner/``; the message is cuBLASLt's). With it off, dots become cuBLAS calls
    (``__cublas$gemm``; cuBLASLt is off by default, ``--xla_gpu_enable_cublaslt``), the
    configuration XLA's own GPU determinism test checks (``CublasDot`` in
    ``xla/service/gpu/determinism_test.cc``). Its cost: no Triton fusion of a GEMM with the
    elementwise work around it.
``--xla_gpu_enable_scatter_determinism_expander=true``
    How a deterministic scatter is made (``gpu_compiler.cc``): with it, a sort and a prefix
    scan (``ScatterDeterminismExpander``); without it (its default in recent XLA), a loop with
    one iteration per index (``ScatterExpander``): 32,768 iterations a step for the embedding
    gradient of a 32 x 1024-token batch.

A user who sets ``--xla_gpu_deterministic_ops=false`` (or
``--xla_gpu_exclude_nondeterministic_ops=false``) in ``XLA_FLAGS`` opts out of all of them:
kernels autotuned by timing (Triton's included) and atomics: no longer reproducible across
processes (``benchmarks/gpu_lm.sh`` measures what each side costs). A flag the user set is kept
as set. A process without a GPU plugin does not get them (XLA:CPU would read none of them).
"""

from __future__ import annotations

import ctypes
import dataclasses
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
# Where a GPU plugin is installed (see the module docstring). Every name is in jaxlib 0.10.2's
# and 0.11.2's XLA (tests/test_xla_flags.py starts a backend with them).
GPU_DETERMINISM_FLAGS = {
    "--xla_gpu_deterministic_ops": "true",
    "--xla_gpu_enable_triton_gemm": "false",
    "--xla_gpu_enable_scatter_determinism_expander": "true",
}
KNOWN_GPU_JAXLIB = ("0.10.", "0.11.")
# Either of these set false in XLA_FLAGS opts out of deterministic GPU execution.
DETERMINISM_SWITCHES = ("xla_gpu_deterministic_ops", "xla_gpu_exclude_nondeterministic_ops")


def apply_default_flags(environ: MutableMapping[str, str] = os.environ,
                        gpu: bool | None = None) -> list[str]:
    """Add the default flags the user has not set to ``XLA_FLAGS``; returns those added.
    ``gpu``: whether JAX has a GPU plugin (None: look)."""
    try:
        jaxlib = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return []
    defaults = dict(DEFAULT_FLAGS) if jaxlib.startswith(KNOWN_JAXLIB) else {}
    flags = environ.get("XLA_FLAGS", "")
    if (jaxlib.startswith(KNOWN_GPU_JAXLIB) and not gpu_determinism_declined(flags)
            and (_gpu_plugin() if gpu is None else gpu)):
        defaults.update(GPU_DETERMINISM_FLAGS)
    added = [f"{name}={value}" for name, value in defaults.items()
             if name.lstrip("-") not in flags]
    if added:
        environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
    return added


def gpu_determinism_declined(flags: str) -> bool:
    """Whether ``XLA_FLAGS`` turns XLA:GPU's deterministic mode off."""
    for flag in flags.split():
        name, _, value = flag.lstrip("-").partition("=")
        if name in DETERMINISM_SWITCHES and value.lower() in ("false", "0"):
            return True
    return False


def _gpu_plugin() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    import jax_plugins

    return any("cuda" in m.name or "rocm" in m.name
               for m in pkgutil.iter_modules(jax_plugins.__path__))


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


def backend_started() -> bool:
    """Whether JAX has started its backend (after which flags, threads and the dispatch mode
    are fixed for the process)."""
    from jax._src import xla_bridge  # no public way to ask whether the backend started

    return xla_bridge.backends_are_initialized()


def run_cpu_calls_inline() -> bool:
    """Turn XLA:CPU's asynchronous dispatch off (see the module docstring) if JAX's backend has
    not started yet (the setting is read when it starts). Returns whether it was set."""
    if backend_started():
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return True


def calls_run_inline() -> bool:
    """Whether a jitted call on this process's devices runs in the calling thread: one CPU
    device with asynchronous dispatch off. Then the call's own duration is its compute time."""
    return (jax.default_backend() == "cpu" and jax.local_device_count() == 1
            and not jax.config.read("jax_cpu_enable_async_dispatch"))


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """What ``configure_process`` did: each setting made, or why not."""

    flags: list[str]  # XLA flags added to XLA_FLAGS
    allocator: bool  # glibc keeps and reuses freed memory
    inline_cpu_calls: bool  # one-device CPU calls run in the calling thread
    notice: str = ""  # one line when the backend had started: nothing could be applied

    def applied(self) -> bool:
        return not self.notice


def configure_process(inline_cpu_calls: bool = True) -> ProcessSettings:
    """Make trainrun's process settings (module docstring): the default XLA flags, glibc's
    allocator, one-device CPU calls inline. Call it once, before the first JAX computation;
    ``trainrun train`` and ``trainrun.run()`` call it themselves when they can. After JAX's
    backend has started nothing is changed and ``notice`` says so."""
    if backend_started():
        return ProcessSettings([], False, False, notice=(
            "process settings not applied: JAX's backend had already started (call "
            "trainrun.configure_process() before the first computation for trainrun's "
            "allocator and CPU dispatch settings; results are the same either way)"))
    flags = apply_default_flags()
    allocator = reuse_freed_memory()
    inline = run_cpu_calls_inline() if inline_cpu_calls else False
    return ProcessSettings(flags, allocator, inline)


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(flags: str, devices: int) -> str:
    """``XLA_FLAGS`` for a child process with ``devices`` simulated CPU devices (any count the
    flags already set is replaced)."""
    kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])
