"""Shared test set-up. Tests that need their own device count or a real process boundary run
the CLI in a subprocess (``run_cli``); the rest run in-process on the one CPU device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainrun

REPO = Path(__file__).resolve().parents[1]
# The settings `trainrun train` makes, before any test starts JAX's backend: in-process runs
# then run as the CLI's do.
trainrun.configure_process()


def cli_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env.update(extra)
    return env


def run_cli(*args: str, devices: int | None = None, timeout: float = 300,
            cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """``trainrun ARGS`` in a fresh Python process; returns the completed process (text)."""
    return subprocess.run([sys.executable, "-m", "trainrun", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=cli_env(devices, **env))


@pytest.fixture
def cli():
    return run_cli
