"""How much host memory this process can still take, and which limit says so.

Three limits bound it, and the smallest wins: what the kernel can give (``MemAvailable``), what
is left of the process's address space under ``ulimit -v`` (``RLIMIT_AS`` less what it already
maps: JAX and XLA reserve much of it at start, ``VmSize``), and what is left under its cgroup's
memory limit (v2 ``memory.max`` less ``memory.current``; v1 ``memory.limit_in_bytes`` less
``memory.usage_in_bytes``), at its own level of the hierarchy or any above it.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")
CGROUPS = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62  # cgroup v1 says "no limit" with LONG_MAX rounded down to a page


class HostMemory(NamedTuple):
    """Bytes this process can still allocate on the host, and the limit that bounds them."""

    free: int
    limit: str  # which, in words that follow "... is free": "(MemAvailable)", "(under ...)"
    raisable: bool = True  # a limit set on this process or its cgroup, not the machine's size


def host_memory_free(proc: Path = PROC, cgroups: Path = CGROUPS) -> HostMemory | None:
    """The smallest of the limits above that this host has; None where none can be read."""
    found = [bound for bound in (_available(proc), _address_space_left(proc),
                                 *_cgroup_left(proc, cgroups)) if bound is not None]
    return min(found, key=lambda bound: bound.free, default=None)


def _available(proc: Path) -> HostMemory | None:
    kib = _field(proc / "meminfo", "MemAvailable:")
    return None if kib is None else HostMemory(kib * 1024, "(MemAvailable)", False)


def _address_space_left(proc: Path) -> HostMemory | None:
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    mapped = _field(proc / "self" / "status", "VmSize:")
    if limit == resource.RLIM_INFINITY or mapped is None:
        return None
    return HostMemory(max(0, limit - mapped * 1024),
                      f"(under the address-space limit: ulimit -v {_mib(limit)}, "
                      f"{_mib(mapped * 1024)} of it mapped already)")


def _cgroup_left(proc: Path, cgroups: Path) -> list[HostMemory | None]:
    """What is left under each memory limit of this process's cgroup and of those above it."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[HostMemory | None] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, mounted at the root or at unified/
            for root in (cgroups, cgroups / "unified"):
                found += [_left(folder, "memory.max", "memory.current")
                          for folder in _folders(root, path)]
        elif "memory" in controllers.split(","):
            found += [_left(folder, "memory.limit_in_bytes", "memory.usage_in_bytes")
                      for folder in _folders(cgroups / "memory", path)]
    return found


def _folders(root: Path, path: str) -> list[Path]:
    """The cgroup folders from ``path`` under ``root`` up to ``root`` (in a container without
    a cgroup namespace of its own, ``path`` is the host's: only the root is there)."""
    folder = root / path.strip("/")
    found = []
    while folder != root and folder.is_relative_to(root):
        found.append(folder)
        folder = folder.parent
    return [*found, root]


def _left(folder: Path, limit_file: str, usage_file: str) -> HostMemory | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= UNLIMITED:
        return None
    limit = int(limit_text)
    return HostMemory(max(0, limit - usage),
                      f"(under the cgroup memory limit: {folder / limit_file} {_mib(limit)}, "
                      f"{_mib(usage)} in use)")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def _field(path: Path, name: str) -> int | None:
    """The number after ``name`` on its line of a /proc file (kB there), or None."""
    try:
        with path.open() as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
