"""Model FLOPs utilization: how much of the hardware's peak a run's steps used.

    FLOPs per step   XLA's cost analysis of the compiled one-step program (per device, times the
                     devices it runs on); where XLA gives no count (some backends answer
                     nothing), the model's analytic count (``analytic_flops``). The summary's
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
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from trainrun.config import CNNModel, MLPModel, ModelConfig, NNXMLPModel, TransformerModel
from trainrun.errors import WriteFailed
from trainrun.platform.user_cache import cache_dir

XLA = "xla_cost_analysis"  # flops_source of a count from XLA

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


# ---- FLOPs of a compiled program -------------------------------------------------------------


def xla_flops(stage: Any) -> float | None:
    """FLOPs in XLA's cost analysis of a lowered or compiled program; None where it gives none
    (an empty answer, a count of 0, or a backend that does not implement it)."""
    try:
        cost = stage.cost_analysis()
    except Exception:  # not implemented on some backends: a missing count must not fail a run
        return None
    if isinstance(cost, (list, tuple)):  # one dict per partition in some jax versions
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def program_flops(compiled: Any) -> float | None:
    """FLOPs of one execution of a compiled program, over all devices it runs on.

    XLA's cost analysis counts the partitioned (per-device) module, so it is multiplied by the
    program's device count. It counts a while loop's body once: pass a one-step program, not a
    K-step ``lax.scan``.
    """
    flops = xla_flops(compiled)
    if flops is None:
        return None
    shardings = [s for s in jax.tree.leaves(compiled.input_shardings) if s is not None]
    devices = len(shardings[0].device_set) if shardings else 1
    return flops * devices


def step_flops(programs: dict[int, Any], one_step: Callable[..., Any], state: Any,
               batch: Any) -> float | None:
    """FLOPs of one training step of a run, by XLA's cost analysis.

    programs: the run's compiled calls by steps per call. The one-step program's count is used
        when there is one; otherwise ``one_step`` is lowered on the shapes of ``state`` and one
        step's slice of the stacked ``batch`` (unpartitioned: the count is already global), as
        a K-step scan's count holds its body once.
    """
    if 1 in programs:
        return program_flops(programs[1])

    def shapes(tree: Any, drop: int) -> Any:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[drop:], x.dtype), tree)

    return xla_flops(jax.jit(one_step).lower(shapes(state, 0), shapes(batch, 1)))


def flops_per_step(programs: dict[int, Any], one_step: Callable[..., Any], state: Any,
                   batch: Any, model: ModelConfig | None,
                   examples: int) -> tuple[float | None, str | None]:
    """FLOPs of one training step and where the figure comes from: XLA's cost analysis where it
    gives a count (``XLA``), else the model's analytic count (``analytic_flops``).

    model: the config section the run built its model from; None for a model passed in, which
        has no analytic count. examples: sequences or examples per step (the global batch).
    """
    flops = step_flops(programs, one_step, state, batch)
    if flops is not None:
        return flops, XLA
    tokens = batch.get("tokens") if isinstance(batch, dict) else None
    seq_len = tokens.shape[-1] - 1 if tokens is not None else None  # the last is a target only
    counted = analytic_flops(model, examples, seq_len)
    return counted if counted is not None else (None, None)


# ---- the model's analytic count --------------------------------------------------------------
#
# Training FLOPs = 3 x forward (the backward pass computes two products per forward one: the
# gradient of the activations and of the weights), and a forward multiply-add is 2 FLOPs: hence
# 6 per multiply-add. Only matmuls and convs are counted: norms, activations, biases, the loss
# and the optimizer's update are a few FLOPs per element, small beside them at these widths.


def transformer_flops(cfg: TransformerModel, examples: int, seq_len: int | None = None) -> float:
    """Training FLOPs of one step of the transformer on ``examples`` sequences of ``seq_len``
    input tokens (default: its context, ``cfg.seq_len``).

        6 x N x tokens + 12 x layers x seq_len x (heads x head_dim) x tokens

    N: the weights that take part in matmuls: per layer q and o (d_model x heads x head_dim
    each), k and v (d_model x kv_heads x head_dim each: fewer with grouped-query attention),
    the MLP's two matrices (three for SwiGLU) of d_model x its width; and the output head once
    (vocab x d_model, tied or not: the input lookup is a gather, not a matmul). Attention: QK^T
    and AV are each 2 x seq_len x heads x head_dim FLOPs per token and layer forward, x3 with
    the backward. The causal mask is not discounted (as in ``benchmarks/gpu_lm.sh`` and PaLM's
    count): this is the dense attention's work, of which a kernel that skips masked blocks
    does a little over half.
    """
    seq = seq_len or cfg.seq_len
    tokens = examples * seq
    d, inner = cfg.d_model, cfg.heads * cfg.attention_head_dim
    kv_inner = cfg.kv_key_heads * cfg.attention_head_dim
    mlp = (3 if cfg.gated else 2) * d * cfg.hidden
    matmul_weights = cfg.vocab * d + cfg.layers * (2 * d * inner + 2 * d * kv_inner + mlp)
    return float(6 * matmul_weights * tokens + 12 * cfg.layers * seq * inner * tokens)


def dense_flops(sizes: list[int], examples: int) -> float:
    """Training FLOPs of one step of an MLP with layer widths ``sizes``: 6 x weights x examples
    (each weight is one multiply-add per example; biases are left out, and the first layer's
    input gradient, which nothing needs, is counted, as in the usual 6 x N)."""
    return float(6 * sum(a * b for a, b in itertools.pairwise(sizes)) * examples)


def cnn_flops(cfg: CNNModel, examples: int) -> float:
    """Training FLOPs of one step of the CNN: 6 x multiply-adds per example x examples.

    A 3x3 "SAME" conv does 9 x c_in x c_out multiply-adds at each pixel of its output (the
    input's size; taps on the border's zero padding included, as usual counts do, where XLA's
    own count leaves them out); the 2x2 pool after it halves the side (skipped once it is 1);
    then the two dense layers. 6 x params would undercount convs, whose weights are used at
    every pixel.
    """
    side, macs = cfg.image_size, 0
    widths = [cfg.in_channels, *cfg.channels]
    for c_in, c_out in itertools.pairwise(widths):
        macs += side * side * 9 * c_in * c_out
        side = side // 2 if side >= 2 else side
    macs += side * side * widths[-1] * cfg.hidden + cfg.hidden * cfg.classes
    return float(6 * macs * examples)


def analytic_flops(model: ModelConfig | None, examples: int,
                   seq_len: int | None = None) -> tuple[float, str] | None:
    """``(FLOPs of one training step, its formula)`` for a model trainrun builds from its
    config (``model``: the config's model section), or None for any other model: a model passed
    in may share weights or run them per position, and 6 x params x examples would misstate it.
    """
    if isinstance(model, TransformerModel):
        return transformer_flops(model, examples, seq_len), "analytic: 6*N*tokens + attention"
    if isinstance(model, MLPModel | NNXMLPModel):
        sizes = [model.features, *model.hidden, model.outputs]
        return dense_flops(sizes, examples), "analytic: 6*N*examples"
    if isinstance(model, CNNModel):
        return cnn_flops(model, examples), "analytic: 6*MACs*examples"
    return None


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
