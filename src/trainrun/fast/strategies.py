"""The fast paths chosen once per run: the switch read (``platform/fast_paths.py``), and for
each seam of the plain path the strategy it takes, built at set-up and never asked again:

    how the state is carried   ``packing.PackedState``, else the ``TrainState`` itself
    where batches come from    ``resident.ResidentBatches``, else the host's, placed each call
    the non-finite guard       ``guard.keep_if_not_branched`` under a scan (branches on
                               CPU), else a select of every leaf
    how metric rows are written  ``writer_thread.WriterThread``, else in the loop's thread
    decoding's output head     ``head_layout.head_transposed``, else the model's own table
    how score programs compile  at LLVM's level 1 on CPU, attending in blocks of
                                ``SCORE_ATTENTION_BLOCK`` rows; else as every program
    how attention is computed  cuDNN's fused attention on an NVIDIA GPU where XLA:GPU is not
                               deterministic; ``tpu_attention.SplashAttention`` on a TPU;
                               else ``AttentionPath()``, XLA's form
    how the head's loss runs   on a TPU, its chunks unrolled one after another; else
                               ``losses.PLAIN_HEAD``, a ``lax.scan`` over the chunks
    how the step's norms sum   on a TPU, ``leaf_norms.leafwise_norm``; else
                               ``step.global_norm``, the leaves laid end to end
    how a fresh state is made  on a TPU with one device, op by op; else one init program

A fast path that is off, or that does not fit the run, leaves the plain path's default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from trainrun.fast.guard import keep_if_not_branched
from trainrun.fast.head_layout import head_transposed
from trainrun.fast.leaf_norms import leafwise_norm
from trainrun.fast.packing import PackedState, packing_for
from trainrun.fast.tpu_attention import SplashAttention
from trainrun.fast.writer_thread import WriterThread
from trainrun.models.losses import PLAIN_HEAD, HeadPath
from trainrun.models.transformer import ATTENTION_BLOCK, AttentionPath
from trainrun.platform import fast_paths
from trainrun.platform.fast_paths import FastPaths
from trainrun.platform.process import gpu_deterministic
from trainrun.program.carried import StateCarrier, TrainStateCarrier
from trainrun.program.decode import HeadLayout, head_as_trained
from trainrun.program.state import TrainState
from trainrun.program.step import KeepIfNot, Norm, global_norm, keep_if_not

# On CPU, one block up to 256 positions; longer ones compile in less time than in training's
# blocks and run as fast (BENCHMARKS.md, "lm-evaluation-harness").
SCORE_ATTENTION_BLOCK = 256

if TYPE_CHECKING:
    from trainrun.program.batch_source import BatchSource


@dataclasses.dataclass(frozen=True)
class Strategies:
    """The strategies of the fast paths that are on (``switch``), for one run or command."""

    switch: FastPaths = dataclasses.field(default_factory=FastPaths)

    def on(self) -> list[str]:
        """The names of the fast paths on (the run's provenance)."""
        return self.switch.on()

    def with_inline_calls(self, inline: bool) -> Strategies:
        """The same, with ``inline_cpu_calls`` as the process made it (``configure_process``)."""
        return Strategies(dataclasses.replace(self.switch, inline_cpu_calls=inline))

    def state_carrier(self, abstract: TrainState) -> StateCarrier:
        """Flat buffers for a small one-device state (``packing.packing_for``)."""
        packing = (packing_for(abstract, jax.device_count()) if self.switch.state_packing
                   else None)
        return TrainStateCarrier() if packing is None else PackedState(packing)

    def batch_source(self, batches: Any, single_device: bool) -> BatchSource:
        """A small in-order dataset on the device (``resident.resident_batches``), cut at the
        data position 0 (``BatchSource.from_offset`` moves it)."""
        # imported here: decoding (``decode_head``) needs no data pipeline
        from trainrun.fast.resident import resident_batches
        from trainrun.program.batch_source import HostBatches

        resident = (resident_batches(batches, single_device, 0, 0)
                    if self.switch.resident_batches else None)
        return HostBatches() if resident is None else resident

    def nonfinite_guard(self, steps_per_call: int) -> KeepIfNot:
        """Branches for a step under a scan (calls of K > 1 steps), grouped by backend
        (``guard.keep_if_not_branched``)."""
        if self.switch.guard_branches and steps_per_call > 1:
            return keep_if_not_branched
        return keep_if_not

    def init_op_by_op(self, devices: int, backend: str | None = None) -> bool:
        """On a TPU with one device, a fresh state built op by op: its small programs compile
        in seconds where the init program compiled for a minute (BENCHMARKS.md, "Fifth run on
        the chip"); the same bits (``program.state.init_state``)."""
        return (self.switch.tpu_op_by_op_init and devices == 1
                and (backend or jax.default_backend()) == "tpu")

    def metric_writes(self) -> WriterThread | None:
        """A writer thread of its own; None: the metric log writes in the loop's thread."""
        return WriterThread() if self.switch.writer_thread else None

    def decode_head(self) -> HeadLayout:
        """The head's table transposed once per decoding call."""
        return head_transposed if self.switch.decode_head_layout else head_as_trained

    def score_compiler_options(self) -> dict[str, Any]:
        """XLA options for the programs that score text (lm-eval's ``ScorePrograms``): on CPU,
        LLVM at level 1 compiles them in less time and runs them as fast (BENCHMARKS.md)."""
        if self._cpu_score():
            return {"xla_backend_optimization_level": 1}
        return {}

    def score_attention(self) -> AttentionPath:
        """The score programs' attention: as every program's, in blocks of 256 query rows on
        CPU: fewer, larger blocks than training's compile in less time and run as fast
        (BENCHMARKS.md)."""
        return dataclasses.replace(
            self.attention(), block=SCORE_ATTENTION_BLOCK if self._cpu_score() else ATTENTION_BLOCK)

    def attention(self, environ: Mapping[str, str] = os.environ,
                  backend: str | None = None) -> AttentionPath:
        """cuDNN's fused attention on an NVIDIA GPU, unless XLA:GPU runs deterministically
        (``XLA_FLAGS``; trainrun's default there): a program with two cuDNN attention calls
        then fails when run (BENCHMARKS.md, "GPU: bfloat16 training with cuDNN attention").
        Splash attention on a TPU. ``backend``: the one to choose for (None: JAX's default)."""
        backend = backend or jax.default_backend()
        fused = (self.switch.fused_gpu_attention and backend == "gpu"
                 and not gpu_deterministic(environ.get("XLA_FLAGS", "")))
        splash = self.switch.tpu_splash_attention and backend == "tpu"
        return AttentionPath(fused_gpu=fused, kernel=SplashAttention() if splash else None)

    def head_loss(self, backend: str | None = None) -> HeadPath:
        """On a TPU, the head's loss in unrolled chunks: a ``lax.scan`` over them costs there
        more than the chunks one after another (docs/internals.md, "Fast paths").
        ``backend``: the one to choose for (None: JAX's default)."""
        if (backend or jax.default_backend()) != "tpu":
            return PLAIN_HEAD
        return HeadPath(unrolled=self.switch.tpu_unrolled_head)

    def norm(self, backend: str | None = None) -> Norm:
        """On a TPU, the step's norms leaf by leaf: the leaves laid end to end are written out
        there (``fast/leaf_norms.py``). ``backend``: the one to choose for (None: JAX's
        default)."""
        if self.switch.tpu_leafwise_norms and (backend or jax.default_backend()) == "tpu":
            return leafwise_norm
        return global_norm

    def _cpu_score(self) -> bool:
        return self.switch.cpu_score_compile and jax.default_backend() == "cpu"


def chosen(environ: Mapping[str, str] = os.environ) -> Strategies:
    """The strategies of the fast paths ``TRAINRUN_FAST_PATHS`` leaves on; a name it does not
    know is refused (``platform/fast_paths.py``)."""
    return Strategies(fast_paths.selected(environ))
