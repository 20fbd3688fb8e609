"""Model FLOPs utilization: how much of the hardware's peak a run's steps used.

    FLOPs per step   XLA's cost analysis of the compiled one-step program (per device, times the
                     devices it runs on); where XLA gives no count (some backends answer
                     nothing), the model's analytic count (``program/flops.py``). The summary's
                     ``flops_source`` names which.
    achieved FLOP/s  FLOPs per step / median steady-state step time
    MFU              achieved / peak, where the peak is a datasheet figure for known accelerators
                     or, on CPU, a ceiling measured on this machine (``trainrun bench ceiling``)

Datasheet peaks are dense (no 2:4 sparsity) per chip. Which entry applies depends on how XLA runs
the run's matmuls: bfloat16 or float16 compute uses the ``bf16`` entry; float32 compute at JAX's
default matmul precision runs as TF32 on NVIDIA Ampere and later and as one bfloat16 pass on a
TPU's MXU, so those entries are used for it; ``jax_default_matmul_precision=highest`` asks for
true fp32.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.errors import WriteFailed
from trainrun.platform.user_cache import cache_dir

# Dense peak FLOP/s per chip. NVIDIA: H100/H200 SXM and H100 PCIe / A100 datasheets (their
# tensor-core figures halved where printed with sparsity). Google Cloud TPU pages: v4 275,
# v5e 197, v5p 459 bf16 TFLOP/s; no fp32 figure is published for TPUs.
PEAKS: dict[str, dict[str, float]] = {
    "h100-sxm": {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "h100-pcie": {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "h200": {"bf16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "a100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "tpu-v4": {"bf16": 275e12},
    "tpu-v5e": {"bf16": 197e12},
    "tpu-v5p": {"bf16": 459e12},
}


def chip_name(device_kind: str) -> str | None:
    """A JAX ``device_kind`` (an NVIDIA H100's, "TPU v5 lite", ...) -> a ``PEAKS`` key."""
    kind = device_kind.lower()
    if "h200" in kind:
        return "h200"
    if "h100" in kind:
        return "h100-pcie" if "pcie" in kind else "h100-sxm"
    if "a100" in kind:
        return "a100"
    if kind.startswith("tpu"):
        if "v4" in kind:
            return "tpu-v4"
        if "v5 lite" in kind or "v5e" in kind or "v5litepod" in kind:
            return "tpu-v5e"
        if "v5p" in kind or kind.strip() == "tpu v5":
            return "tpu-v5p"
    return None


def matmul_precision_entry(platform_name: str, compute_dtype: str) -> str:
    """The ``PEAKS`` column that the run's matmuls execute at (see the module docstring)."""
    if compute_dtype in ("bfloat16", "float16"):
        return "bf16"
    # read through `values`: jax.config's flag attributes are set at run time, undeclared
    precision = str(jax.config.values["jax_default_matmul_precision"] or "default").lower()
    if precision in ("highest", "float32"):
        return "fp32"
    return "bf16" if platform_name == "tpu" else "tf32"


@dataclasses.dataclass(frozen=True)
class Peak:
    """The peak a run is measured against: all of its devices together."""

    flops_per_s: float
    entry: str  # which figure: "bf16", "tf32", "fp32" or "measured fp32 matmul"
    source: str  # where the figure comes from, in words

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def find_peak(platform_name: str, device_kind: str, device_count: int,
              compute_dtype: str = "float32") -> tuple[Peak | None, str]:
    """The peak for ``device_count`` devices, or ``(None, why not)``."""
    if platform_name == "cpu":
        ceiling = cached_ceiling()
        if ceiling is None:
            return None, ("no CPU ceiling measured on this machine yet; run "
                          "`trainrun bench ceiling` once to get MFU")
        # One measured figure for the whole host: simulated CPU devices share its cores.
        return Peak(ceiling["flops_per_s"], "measured fp32 matmul",
                    f"trainrun bench ceiling: {ceiling['size']}x{ceiling['size']} float32 matmul "
                    f"on {ceiling['cpu']} ({ceiling['cores']} cores), "
                    f"measured {ceiling['measured_at']}"), ""
    chip = chip_name(device_kind)
    if chip is None:
        return None, f"no peak FLOP/s known for device kind {device_kind!r}"
    entry = matmul_precision_entry(platform_name, compute_dtype)
    per_chip = PEAKS[chip].get(entry)
    if per_chip is None:
        return None, f"no published {entry} peak for {chip}"
    return Peak(per_chip * device_count, entry,
                f"datasheet: {chip} dense {entry} {per_chip / 1e12:g} TFLOP/s per chip "
                f"x {device_count}"), ""


def utilization(flops_per_step: float | None, step_s: float | None,
                peak: Peak | None, why_no_peak: str = "",
                flops_source: str | None = None) -> dict[str, Any]:
    """The summary's MFU block: flops_per_step and where it comes from (``flops_source``),
    flops_per_s, mfu, and the peak it used."""
    flops_per_s = flops_per_step / step_s if flops_per_step and step_s else None
    mfu = flops_per_s / peak.flops_per_s if flops_per_s and peak else None
    why = [] if flops_per_step else ["no FLOP count for the step: XLA's cost analysis gave "
                                     "none and the model has no analytic count"]
    if peak is None:
        why.append(why_no_peak or "no peak FLOP/s known")
    return {
        "flops_per_step": flops_per_step,
        "flops_source": flops_source if flops_per_step else None,
        "flops_per_s": flops_per_s,
        "mfu": mfu,
        "peak": peak.to_dict() if peak else None,
        "mfu_note": "" if mfu is not None else "; ".join(why) or "no steady-state step time",
    }


# ---- the measured CPU ceiling ----------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_key() -> str:
    # A figure holds for one processor model, core count and XLA build.
    return f"{_cpu_model()}|{len(os.sched_getaffinity(0))} cores|jaxlib {jax.__version__}"


def measure_ceiling(size: int = 2048, repeats: int = 10) -> dict[str, Any]:
    """FLOP/s of a ``size``-square float32 matmul on the default device: warmed up, each run
    ended by ``block_until_ready``, the fastest of ``repeats`` kept (a ceiling, not a typical)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (size, size), jnp.float32)
    b = jax.random.normal(k2, (size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    for _ in range(2):
        matmul(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    flops = 2.0 * size**3
    return {
        "flops_per_s": flops / min(times),
        "median_flops_per_s": flops / statistics.median(times),
        "size": size,
        "repeats": repeats,
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def save_ceiling(record: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """Keep ``record`` as this machine's ceiling unless a higher one is kept already; returns
    the file and the ceiling now in force.

    A ceiling is the best the machine has shown: a measurement taken while other work shared
    the cores is far lower, and replacing the figure with it would make every later MFU rise
    past what the machine can do."""
    path = ceiling_file()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict):  # not what this writes: replaced
        table = {}
    kept = table.get(_machine_key())
    best = record
    if kept and kept.get("flops_per_s", 0) >= record["flops_per_s"]:
        best = {**kept, "measurements": kept.get("measurements", 1) + 1}
    else:
        best = {**record, "measurements": (kept or {}).get("measurements", 0) + 1}
    table[_machine_key()] = best
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(table, indent=2) + "\n")
        tmp.replace(path)
    except OSError as err:
        raise WriteFailed(f"cannot write {path}: {err.strerror}; point TRAINRUN_CACHE_DIR at a "
                          "writable directory") from None
    return path, best


def ceiling_file() -> Path:
    """The file the measured ceilings are kept in, its folder made; a cache directory that
    cannot be one (a file, no permission) is ``WriteFailed`` naming it."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteFailed(f"cannot use {folder} as trainrun's cache directory: {err.strerror}; "
                          "point TRAINRUN_CACHE_DIR at a writable directory") from None
    return folder / "ceiling.json"


def cached_ceiling() -> dict[str, Any] | None:
    """The figure ``trainrun bench ceiling`` saved for this machine, if any."""
    path = cache_dir() / "ceiling.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    kept = table.get(_machine_key()) if isinstance(table, dict) else None
    return kept if isinstance(kept, dict) and "flops_per_s" in kept else None
