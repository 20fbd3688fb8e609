"""Every process-wide setting trainrun makes (XLA flags, glibc's allocator, JAX's CPU dispatch,
JAX's compiled-program cache), here and nowhere else, and when each is made:

    import trainrun          ``apply_default_flags`` only: the XLA flags a promise needs before
                             JAX's backend starts. Nothing else in the process changes.
    trainrun train / run()   ``configure_process``: the flags, the allocator, the dispatch
                             setting and the compiled-program cache, if JAX's backend has not
                             started yet (else a one-line notice, and the run goes on without
                             them).
    eval, sample, lm-eval,   ``keep_compiled_programs`` only: the compiled-program cache.
    export, verify-resume
    a library user           ``trainrun.configure_process()`` before the first computation.
    the ``trainrun`` program ``command_process`` around the command: Python's cyclic
                             collector leaves the objects alive at its start and at its end,
                             and optional parts of libraries only a user's code would use are
                             not loaded (``command_owns_process``).

What each setting does and why: docs/internals.md, "Process settings in detail".
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import importlib.util
import os
import pkgutil
import platform
import re
import shlex
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from importlib import metadata
from pathlib import Path

import jax

from trainrun.errors import UserError
from trainrun.platform import fast_paths
from trainrun.platform.accelerator import held_device_line
from trainrun.platform.user_cache import CompilationCacheWarning, cache_dir

# flag -> value. Only for jaxlib releases whose XLA knows the flag: XLA aborts the process at
# backend start on a flag it does not know.
DEFAULT_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ""}
KNOWN_JAXLIB = ("0.10.",)
# Where a GPU plugin is installed (docs/internals.md, "Process settings in detail"). Every name
# is in jaxlib 0.10.2's and 0.11.2's XLA (tests/platform/test_process.py starts a backend with
# them).
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


def _switch_settings(flags: str) -> list[tuple[str, str]]:
    """Each setting of a determinism switch in ``XLA_FLAGS``, in order: (name, value in lower
    case; a bare flag's is "true")."""
    settings = []
    for flag in flags.split():
        name, sep, value = flag.lstrip("-").partition("=")
        if name in DETERMINISM_SWITCHES:
            settings.append((name, value.lower() if sep else "true"))
    return settings


def gpu_determinism_declined(flags: str) -> bool:
    """Whether ``XLA_FLAGS`` turns XLA:GPU's deterministic mode off."""
    return any(value in ("false", "0") for _, value in _switch_settings(flags))


def gpu_deterministic(flags: str) -> bool:
    """Whether ``XLA_FLAGS`` puts XLA:GPU in its deterministic mode: either switch on, each
    as its last setting says."""
    return any(value in ("true", "1") for value in dict(_switch_settings(flags)).values())


def _gpu_plugin() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    jax_plugins = importlib.import_module("jax_plugins")  # by name: absent on a CPU host

    return any("cuda" in m.name or "rocm" in m.name
               for m in pkgutil.iter_modules(jax_plugins.__path__))


# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def reuse_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Make glibc keep and reuse large freed blocks (docs/internals.md, "Process settings in
    detail"). Call before JAX starts its backend threads. Returns whether the allocator was set."""
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
    jax_plugins = importlib.import_module("jax_plugins")  # by name: absent on a CPU host

    return any(pkgutil.iter_modules(jax_plugins.__path__))


_command_owns_process = False  # set by command_process while the command runs


@contextlib.contextmanager
def command_process() -> Iterator[None]:
    """The ``trainrun`` program's own process around its one command (the console script and
    ``python -m trainrun``; never a library user's process, where ``cli.main`` and
    ``import trainrun`` change neither of these):

    - Python's cyclic garbage collector leaves the objects alive when the command starts
      (JAX's, imported with trainrun's package) and when it ends out of its walks
      (``gc.freeze``). They live as long as the process, and Python walked them again at every
      full collection and at exit (what that cost a short command: BENCHMARKS.md).
    - ``command_owns_process()`` is true: no code but trainrun's runs here, so the optional parts
      of a library that only a user's code would reach are left unloaded.

    docs/internals.md, "The trainrun program's own process"."""
    global _command_owns_process
    gc.freeze()
    _command_owns_process = True
    try:
        yield
    finally:
        gc.freeze()  # the process ends next: its exit's collections skip what is alive now
        _command_owns_process = False


def command_owns_process() -> bool:
    """Whether this is the ``trainrun`` program's process, running its command
    (``command_process``), rather than a library user's."""
    return _command_owns_process


def backend_started() -> bool:
    """Whether JAX has started its backend (after which flags, threads and the dispatch mode
    are fixed for the process)."""
    from jax._src import xla_bridge  # no public way to ask whether the backend started

    return xla_bridge.backends_are_initialized()


def require_backend() -> None:
    """JAX's devices, or one line saying why there are none: an ``XLA_FLAGS`` word that is no
    XLA flag (XLA would abort the process as its backend starts), a ``JAX_PLATFORMS`` that
    names a platform this machine lacks (JAX raises, then asserts on every later call), a TPU
    another process holds (``accelerator.held_device_line``), or a plugin that fails to
    start."""
    if not backend_started():
        check_xla_flags()
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as err:
        held = held_device_line(str(err))
        if held is not None:
            raise UserError(held) from None
        asked = os.environ.get("JAX_PLATFORMS")
        lines = str(err).strip().splitlines()
        why = f" ({lines[0]})" if lines else ""
        if asked:
            raise UserError(f"JAX cannot start a backend for JAX_PLATFORMS={asked}{why}: this "
                            "machine lacks it or its plugin; name a platform it has (e.g. "
                            "JAX_PLATFORMS=cpu) or unset it") from None
        raise UserError(f"JAX cannot start its backend{why}; check the accelerator's driver and "
                        "JAX plugin, or run on CPU with JAX_PLATFORMS=cpu") from None


def check_xla_flags(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse, on one line, an ``XLA_FLAGS`` word that is not ``--xla_name`` or
    ``--xla_name=value``: XLA's own check, at backend start, ends the process with a fatal log
    line instead. (A well-formed name XLA does not know still meets XLA's check.)"""
    flags = environ.get("XLA_FLAGS", "")
    try:
        words = shlex.split(flags)
    except ValueError:
        words = [flags]  # an unclosed quote
    for word in words:
        if not re.fullmatch(r"--?xla_\w+(=.*)?", word, flags=re.DOTALL):
            raise UserError(f"XLA_FLAGS holds {word!r}, which is not an XLA flag "
                            "(--xla_name=value); correct it or unset XLA_FLAGS")


def run_cpu_calls_inline() -> bool:
    """Turn XLA:CPU's asynchronous dispatch off (docs/internals.md, "Process settings in detail")
    if JAX's backend has not started yet (the setting is read when it starts). Returns whether
    it was set."""
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
    compiled_programs: Path | None = None  # the folder compiled programs are kept in
    notice: str = ""  # one line when the backend had started: nothing could be applied

    def applied(self) -> bool:
        return not self.notice


def configure_process(inline_cpu_calls: bool | None = None) -> ProcessSettings:
    """Make trainrun's process settings (docs/internals.md): the default XLA flags, glibc's
    allocator, one-device CPU calls inline (a fast path: None leaves it to
    ``TRAINRUN_FAST_PATHS``), compiled programs kept for later processes
    (``keep_compiled_programs``). Call it once, before the first JAX computation; ``trainrun
    train`` and ``trainrun.run()`` call it themselves when they can. After JAX's backend has
    started nothing is changed and ``notice`` says so."""
    global _made
    if backend_started():
        if _made is not None:  # made before the backend started (trainrun train, then run())
            return _made
        return ProcessSettings([], False, False, notice=(
            "process settings not applied: JAX's backend had already started (call "
            "trainrun.configure_process() before the first computation for trainrun's "
            "allocator and CPU dispatch settings; results are the same either way)"))
    if inline_cpu_calls is None:
        inline_cpu_calls = fast_paths.selected().inline_cpu_calls
    flags = apply_default_flags()
    allocator = reuse_freed_memory()
    inline = run_cpu_calls_inline() if inline_cpu_calls else False
    _made = ProcessSettings(flags, allocator, inline, keep_compiled_programs())
    return _made


_made: ProcessSettings | None = None  # what this process's first call made, before JAX started


COMPILED_PROGRAMS = "compiled"  # the folder of compiled programs under the user cache
COMPILED_PROGRAMS_BYTES = 2**31  # the oldest read programs go past this
# Before it, XLA:CPU logs an error-level line on stderr each time it loads a cached program.
CACHE_QUIET_JAXLIB = (0, 10, 2)
COMPILATION_CACHE_VAR = "TRAINRUN_COMPILATION_CACHE"  # 0 (off, false, no) or a folder
CACHE_OFF = ("0", "off", "false", "no")
# JAX settings a user's own environment variable names are theirs: trainrun leaves them.
CACHE_SETTINGS = {
    # Programs that compile in well under a second are most of a short command's compiling.
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    # Every size, and no platform override of the smallest entry kept.
    "jax_persistent_cache_min_entry_size_bytes": -1,
}


def _jaxlib_at_least(version: tuple[int, ...]) -> bool:
    import jaxlib.version

    return tuple(jaxlib.version.__version_info__) >= version


def host_cpu() -> str:
    """This host's CPU as a folder name: its architecture and a digest of its model and
    feature flags (``/proc/cpuinfo`` where there is one)."""
    try:
        info = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        info = platform.processor()
    lines = sorted({line.split(":", 1)[1].strip() for line in info.splitlines()
                    if line.split(":", 1)[0].strip() in ("model name", "flags", "Features",
                                                          "CPU part", "CPU implementer")})
    digest = hashlib.sha256("\n".join(lines or [info]).encode()).hexdigest()[:12]
    return f"{platform.machine() or 'cpu'}-{digest}"


def compiled_programs_folder(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where this process keeps the programs it compiles: the folder ``$TRAINRUN_COMPILATION_
    CACHE`` names, else ``compiled/<host CPU>`` under trainrun's user cache; None where that
    variable turns the cache off (``0``, ``off``, ``false``, ``no``) or the user has named
    JAX's own cache (``JAX_COMPILATION_CACHE_DIR`` or ``jax_compilation_cache_dir``) or turned
    it off (``jax_enable_compilation_cache``)."""
    chosen = environ.get(COMPILATION_CACHE_VAR, "").strip()
    if chosen.lower() in CACHE_OFF:
        return None
    jax_values = jax.config.values  # these two options are not readable by jax.config.read
    if (environ.get("JAX_COMPILATION_CACHE_DIR") or jax_values["jax_compilation_cache_dir"]
            or not jax_values["jax_enable_compilation_cache"]):
        return None
    if chosen and chosen.lower() not in ("1", "on", "true", "yes"):
        return Path(chosen).expanduser()
    # XLA:CPU's programs are machine code for this CPU; a home shared by other CPUs keeps theirs
    # apart.
    return cache_dir() / COMPILED_PROGRAMS / host_cpu()


def keep_compiled_programs(folder: Path | None = None) -> Path | None:
    """Keep the programs this process compiles in ``folder`` (default
    ``compiled_programs_folder()``) for later processes: JAX's persistent compilation cache,
    which turns a command's compiling into reading files the next time. A cache the user named
    or turned off is left as it is, and nothing changes once JAX's backend has started. A
    folder that is a symlink is not followed (JAX evicts old programs from it: it must be
    trainrun's own); one that cannot be written leaves the cache off with one
    ``CompilationCacheWarning``. With several processes JAX writes from process 0 only and
    every process reads. Returns the folder in use, or None; a second call returns what the
    first made."""
    global _kept
    if _kept is not None:
        return _kept.folder
    if backend_started() or not _jaxlib_at_least(CACHE_QUIET_JAXLIB):
        return None
    _kept = _Kept(_keep(folder))
    return _kept.folder


@dataclasses.dataclass(frozen=True)
class _Kept:
    folder: Path | None


_kept: _Kept | None = None  # what this process's first keep_compiled_programs made


def kept_programs_folder() -> Path | None:
    """The folder this process keeps its compiled programs in (``keep_compiled_programs``), or
    None where it keeps none."""
    return _kept.folder if _kept is not None else None


def _keep(folder: Path | None) -> Path | None:
    if folder is not None:
        ours = [folder]
    else:
        folder = compiled_programs_folder()
        if folder is None:
            return None
        # The default's per-CPU folder and the ``compiled`` folder above it are both trainrun's.
        ours = [folder, folder.parent] if folder.parent.name == COMPILED_PROGRAMS else [folder]
    if any(path.is_symlink() for path in ours):
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # writable for files, not only for mkdir
            pass
    except OSError as err:
        warnings.warn(f"compiled programs are not kept: cannot write {folder} "
                      f"({(err.strerror or str(err)).lower()}); make it writable, point "
                      f"{COMPILATION_CACHE_VAR} at a folder that is, or set it to 0",
                      CompilationCacheWarning, stacklevel=3)
        return None  # an unwritable cache costs a compile, never the command
    jax.config.update("jax_compilation_cache_dir", str(folder))
    if importlib.util.find_spec("filelock") is not None:  # JAX evicts only under a file lock
        jax.config.update("jax_compilation_cache_max_size", COMPILED_PROGRAMS_BYTES)
    for name, value in CACHE_SETTINGS.items():
        if name.upper() not in os.environ:
            jax.config.update(name, value)
    return folder


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_device_count(flags: str, devices: int) -> str:
    """``XLA_FLAGS`` for a child process with ``devices`` simulated CPU devices (any count the
    flags already set is replaced)."""
    kept = [f for f in flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={devices}"])
