"""pyproject.toml's ranges and the lock: every locked version lies in its range, every direct
dependency has the lower bound .ci/lowest tests, and a run's provenance names the lock's digest
(sha256) in a source checkout, "unknown" elsewhere."""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from trainrun.reporting.provenance import lock_digest, provenance

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# the extras requirements.lock holds (make lock); bench's torch is in requirements-bench.lock
LOCKED_EXTRAS = ("report", "datasets", "tensorboard", "wandb", "huggingface", "text",
                 "records", "cloud", "test")


def pins(lock: Path) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s\\;]+)", lock.read_text(), re.MULTILINE)
    return {canonicalize_name(name): version for name, version in found}


def requirements(*groups: str) -> list[Requirement]:
    listed = [r for g in groups for r in
              (PROJECT["dependencies"] if g == "core" else PROJECT["optional-dependencies"][g])]
    return [Requirement(r) for r in listed if not r.startswith("trainrun[")]


def test_every_locked_version_is_in_its_range():
    locked = pins(REPO / "requirements.lock") | pins(REPO / "requirements-bench.lock")
    for req in requirements("core", *LOCKED_EXTRAS, "bench"):
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is not in the lock: make lock"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"the lock's {req.name}=={locked[name]} is outside pyproject.toml's {req}"


def test_the_training_lock_is_the_core_at_the_full_locks_versions():
    """make train installs requirements-train.lock alone: every core dependency, nothing of
    an extra's that the core does not need, each at the version make test installs (the
    bitwise promises hold per lock)."""
    train, full = pins(REPO / "requirements-train.lock"), pins(REPO / "requirements.lock")
    assert {canonicalize_name(r.name) for r in requirements("core")} <= train.keys()
    assert all(full.get(name) == version for name, version in train.items()), \
        {n: (v, full.get(n)) for n, v in train.items() if full.get(n) != v}
    assert not {"matplotlib", "torch", "safetensors", "tokenizers", "gcsfs", "pytest"} & \
        train.keys()


def test_every_direct_dependency_has_a_tested_lower_bound_and_no_exact_pin():
    for req in requirements("core", *LOCKED_EXTRAS, "bench"):
        operators = {s.operator for s in req.specifier}
        assert ">=" in operators and "==" not in operators, str(req)
    jax = next(r for r in requirements("core") if r.name == "jax")
    assert all(jax.specifier.contains(v) for v in ("0.10.1", "0.10.2", "0.11.0", "0.11.3"))


def test_provenance_names_the_lock_digest():
    expected = hashlib.sha256((REPO / "requirements.lock").read_bytes()).hexdigest()
    assert provenance("digest")["lock"] == expected


def test_lock_digest_only_beside_a_source_checkout(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("numpy==2.0\n")
    assert lock_digest(lock) == "unknown"  # an installed wheel: no src/trainrun beside it
    (tmp_path / "src" / "trainrun").mkdir(parents=True)
    assert lock_digest(lock) == "unknown"  # cached per path: computed once per process
    lock_digest.cache_clear()
    assert lock_digest(lock) == hashlib.sha256(b"numpy==2.0\n").hexdigest()
    assert lock_digest(tmp_path / "missing.lock") == "unknown"
    assert lock_digest(tmp_path / "src") == "unknown"  # not a readable file
