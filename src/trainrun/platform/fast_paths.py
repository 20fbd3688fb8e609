"""The fast-path switch: every speed-up that serves one backend or one model size, named in one
place, each turned off by ``TRAINRUN_FAST_PATHS``. Turning one off changes only speed (tests
run parity, K-invariance and resume both ways); the plain path is what remains with all off.
``fast/strategies.py`` reads this switch once per run and chooses the strategy each seam of the
plain path takes; only ``inline_cpu_calls`` is a process setting, read here by
``platform/process.py``.

    state_packing       a small one-device state crosses the jit boundary as a few flat
                        buffers (``fast/packing.py``)
    resident_batches    a small in-order dataset placed on the device once, each step cutting
                        its batch there (``fast/resident.py``)
    inline_cpu_calls    one-device XLA:CPU calls run in the calling thread
                        (``platform/process.py``, made by ``configure_process``)
    writer_thread       metric rows written by one thread beside the loop
                        (``fast/writer_thread.py``)
    guard_branches      inside a scan on CPU, the non-finite guard as branches over a few
                        leaves each instead of a select of every leaf (``fast/guard.py``)
    decode_head_layout  decoding multiplies by the output head's table laid out [d_model,
                        vocab] once per call, not [vocab, d_model] (``fast/head_layout.py``)
    cpu_score_compile   on CPU, lm-eval's score programs compile at LLVM's optimisation level
                        1, not 2, and attend in blocks of 256 query rows, not 64
                        (``harness.ScorePrograms``)
    fused_gpu_attention  on an NVIDIA GPU in bfloat16 or float16, causal attention is cuDNN's
                        fused kernel where XLA:GPU is not deterministic
                        (``transformer.AttentionPath``)
    tpu_splash_attention  on a TPU, causal attention is Pallas' splash attention, blocks
                        measured there and a fused backward pass (``fast/tpu_attention.py``)
    tpu_unrolled_head   on a TPU, the chunks of the head's loss run one after another in
                        straight-line code, not a ``lax.scan`` (``losses.HeadPath``)
    tpu_leafwise_norms  on a TPU, the step's norms add each leaf's sum of squares, not one
                        sum over the leaves laid end to end (``fast/leaf_norms.py``)
    tpu_op_by_op_init   on a TPU with one device, a fresh run's state is built op by op, not
                        compiled as one init program (``program.state.init_state``)

``TRAINRUN_FAST_PATHS``: ``all`` (the default), ``none``, or the names to keep on, comma
separated. Why each pays, and on what: docs/internals.md, "Fast paths".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from trainrun.errors import UserError

ENVIRONMENT_VARIABLE = "TRAINRUN_FAST_PATHS"


@dataclasses.dataclass(frozen=True)
class FastPaths:
    """Which fast paths are on (module docstring)."""

    state_packing: bool = True
    resident_batches: bool = True
    inline_cpu_calls: bool = True
    writer_thread: bool = True
    guard_branches: bool = True
    decode_head_layout: bool = True
    cpu_score_compile: bool = True
    fused_gpu_attention: bool = True
    tpu_splash_attention: bool = True
    tpu_unrolled_head: bool = True
    tpu_leafwise_norms: bool = True
    tpu_op_by_op_init: bool = True

    def on(self) -> list[str]:
        """The names of the fast paths that are on."""
        return [name for name in names() if getattr(self, name)]

    @classmethod
    def none(cls) -> FastPaths:
        """The plain path: every fast path off."""
        return cls(**{name: False for name in names()})


def names() -> list[str]:
    return [field.name for field in dataclasses.fields(FastPaths)]


def selected(environ: Mapping[str, str] = os.environ) -> FastPaths:
    """The fast paths ``TRAINRUN_FAST_PATHS`` leaves on; a name it does not know is refused."""
    value = environ.get(ENVIRONMENT_VARIABLE, "all").strip().lower()
    if value in ("", "all"):
        return FastPaths()
    if value == "none":
        return FastPaths.none()
    chosen = {part.strip() for part in value.split(",") if part.strip()}
    unknown = sorted(chosen - set(names()))
    if unknown:
        raise UserError(f"{ENVIRONMENT_VARIABLE}={value!r} names {', '.join(unknown)}, which "
                        f"is no fast path; give all, none, or some of {', '.join(names())}")
    return FastPaths(**{name: name in chosen for name in names()})
