"""The host memory a run may count on: the smallest of MemAvailable, what ``ulimit -v`` leaves
and what the cgroup's memory limit leaves, named in words. Read from a made-up ``/proc`` and
``/sys/fs/cgroup``, so each limit can be set without setting it on the test's process."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from trainrun.platform.host_memory import HostMemory, host_memory_free

GiB, KiB = 2**30, 1024


def fake_host(tmp_path: Path, available: int, mapped: int, cgroup: str) -> tuple[Path, Path]:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {64 * GiB // KiB} kB\n"
                                  f"MemAvailable: {available // KiB} kB\n")
    (proc / "self" / "status").write_text(f"Name: python\nVmSize:\t{mapped // KiB} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    cgroups.mkdir()
    return proc, cgroups


def limit(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")


@pytest.fixture
def no_ulimit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def test_without_limits_it_is_mem_available(tmp_path, no_ulimit):
    proc, cgroups = fake_host(tmp_path, 8 * GiB, 2 * GiB, "0::/\n")
    limit(cgroups, {"memory.max": "max", "memory.current": str(GiB)})
    assert host_memory_free(proc, cgroups) == HostMemory(8 * GiB, "(MemAvailable)", False)


def test_the_address_space_limit_counts_less_what_is_mapped(tmp_path, monkeypatch):
    proc, cgroups = fake_host(tmp_path, 8 * GiB, 2 * GiB, "0::/\n")
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (5 * GiB, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else (0, 0)))
    found = host_memory_free(proc, cgroups)
    assert found is not None and found.free == 3 * GiB and found.raisable
    assert found.limit == ("(under the address-space limit: ulimit -v 5,120 MiB, 2,048 MiB of "
                           "it mapped already)")


def test_a_cgroup_v2_limit_at_its_own_level_or_above(tmp_path, no_ulimit):
    proc, cgroups = fake_host(tmp_path, 8 * GiB, GiB, "0::/jobs/train\n")
    limit(cgroups / "jobs" / "train", {"memory.max": str(6 * GiB),
                                       "memory.current": str(2 * GiB)})
    limit(cgroups / "jobs", {"memory.max": "max", "memory.current": str(2 * GiB)})
    found = host_memory_free(proc, cgroups)
    assert found is not None and found.free == 4 * GiB and found.raisable
    assert found.limit == (f"(under the cgroup memory limit: {cgroups}/jobs/train/memory.max "
                           "6,144 MiB, 2,048 MiB in use)")
    limit(cgroups / "jobs", {"memory.max": str(3 * GiB), "memory.current": str(2 * GiB)})
    found = host_memory_free(proc, cgroups)  # the parent's limit is the tighter one
    assert found is not None and found.free == GiB and "jobs/memory.max" in found.limit


def test_a_cgroup_v1_limit_and_its_no_limit_value(tmp_path, no_ulimit):
    proc, cgroups = fake_host(tmp_path, 8 * GiB, GiB,
                              "5:cpu,cpuacct:/x\n4:memory:/process_api/x\n0::/\n")
    folder = cgroups / "memory" / "process_api" / "x"
    limit(folder, {"memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
                   "memory.usage_in_bytes": str(GiB)})
    assert host_memory_free(proc, cgroups) == HostMemory(8 * GiB, "(MemAvailable)", False)
    limit(folder, {"memory.limit_in_bytes": str(2 * GiB)})
    found = host_memory_free(proc, cgroups)
    assert found is not None and found.free == GiB
    assert f"{folder}/memory.limit_in_bytes 2,048 MiB, 1,024 MiB in use" in found.limit


def test_a_host_that_says_nothing(tmp_path, no_ulimit):
    assert host_memory_free(tmp_path / "none", tmp_path / "none") is None
