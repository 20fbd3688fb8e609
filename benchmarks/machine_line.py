"""The line a benchmark prints about the machine it ran on: the CPU model, its count, the load
average and JAX's version (BENCHMARKS.md names each figure's machine)."""

from __future__ import annotations

import os
import platform
import subprocess

import jax


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if line.startswith("Model name")), platform.processor())
    return (f"{model}, {os.cpu_count()} CPUs, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, jax {jax.__version__}")
