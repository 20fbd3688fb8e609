"""The jitted step programs of a run: what one call of K steps takes (the state, donated, and K
stacked host batches) and gives back (the new state and one float32 array of every step's
metrics). The loop reads those arrays a window at a time (``training/metrics_reader.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from trainrun.models import Model
from trainrun.program import flops
from trainrun.program.batch_source import BatchSource, HostBatches
from trainrun.program.carried import StateCarrier, TrainStateCarrier
from trainrun.program.optim import Optimizer
from trainrun.program.precision import Policy
from trainrun.program.sharding import traced_on
from trainrun.program.state import TrainState
from trainrun.program.step import KeepIfNot, Norm, global_norm, keep_if_not, make_train_step
from trainrun.program.streamed import Emit, streamed

Batch = Any


class PhaseTimer(Protocol):
    """Where the programs' compile time is counted (``reporting.timing.Stopwatch``)."""

    def phase(self, name: str) -> AbstractContextManager[None]: ...


def pack_metrics(metrics: dict[str, jax.Array]) -> jax.Array:
    """Scalar metrics -> one float32 array ``[..., n]`` (names sorted): one transfer per call
    instead of one per metric. Counts stay exact below 2**24."""
    return jnp.stack([jnp.asarray(metrics[name], jnp.float32) for name in sorted(metrics)],
                     axis=-1)


class CompiledSteps:
    """The jitted step programs of a run: one for K steps per call, one more for a shorter tail
    call (each compiled once). Compiled ahead of time so compile time is its own figure; the
    jitted call then finds that executable in JAX's cache and keeps its fast dispatch path.

    The calls take and return the state as ``carried``, in the form ``carrier`` gives it
    (``carried.py``: the ``TrainState`` itself unless another carrier is given). ``carry`` and
    ``state`` convert; the loop converts back only where it needs the state (checkpoints,
    eval). source: where the calls' batches come from (``batch_source.py``: the host's unless
    another source is given). keep: how a step that is not finite keeps the old state; norm:
    how its norms are taken (both ``step.make_train_step``)."""

    def __init__(self, model: Model, optimizer: Optimizer, steps_per_call: int,
                 watch: PhaseTimer, *, abstract: TrainState | None = None,
                 accumulate: int = 1, policy: Policy | None = None,
                 state_sharding: TrainState | None = None,
                 batch_sharding: jax.sharding.NamedSharding | None = None,
                 stream: Emit | None = None, source: BatchSource | None = None,
                 carrier: StateCarrier | None = None, keep: KeepIfNot = keep_if_not,
                 norm: Norm = global_norm):
        scanned = steps_per_call > 1
        self.one_step = make_train_step(  # what one step computes (FLOPs per step)
            model, optimizer, accumulate=accumulate, policy=policy, keep=keep, norm=norm)
        single = self.one_step if stream is None else streamed(self.one_step, stream)
        self.source = source or HostBatches()
        self.abstract = abstract
        self.carrier = carrier or TrainStateCarrier()
        self.metric_names: list[str] = []  # the packed rows' columns, named as traced
        body = self.carrier.around(_rows_step(single, scanned, self.source, self.metric_names))
        self.state_sharding = state_sharding
        self.fn = _jit_donated(body, self.carrier.sharding(state_sharding), batch_sharding,
                               self.source)
        self.watch = watch
        self.programs: dict[int, Any] = {}
        self.texts: dict[int, bytes] = {}  # each program's StableHLO (``flops.program_text``)

    def carry(self, state: TrainState) -> Any:
        """``state`` as the calls take it."""
        return self.carrier.carry(state)

    def state(self, carried: Any) -> TrainState:
        """The ``TrainState`` in ``carried`` (new arrays where ``carrier.fresh_arrays``)."""
        return self.carrier.state(carried)

    def carried_shapes(self) -> Any:
        """The shapes, dtypes and placements of what the calls carry, from the abstract state:
        enough to compile a program before any state exists. The calls then find that
        executable in JAX's cache (they take arrays placed as these say)."""
        assert self.abstract is not None, "built without the abstract state"
        return self.carrier.shapes(self.abstract, self.state_sharding)

    def compile(self, k: int, carried: Any, batch: Batch) -> jax.stages.Compiled:
        """Compile the program for calls of ``k`` steps (before its call is timed); ``carried``
        and ``batch`` may be arrays or their shapes (``jax.ShapeDtypeStruct``)."""
        with self.watch.phase("compile"):
            lowered = self.fn.lower(carried, batch)
            self.texts[k] = flops.program_text(lowered)
            self.programs[k] = lowered.compile()
        assert self.metric_names, "the step's metrics are named when it is traced"
        return self.programs[k]

    def flops_per_step(self, example: Batch, counted: Any,
                       batch_size: int) -> tuple[float | None, str | None]:
        """FLOPs of one step and their source (``flops.flops_per_step``); ``example``: a batch the
        calls took; the batch source may count the step alone (``BatchSource.counted``)."""
        compiled, batch = self.source.counted(self.programs, example)
        # Every program holds the step: together they name it for the count kept between runs.
        texts = [self.texts[k] for k in sorted(self.texts)]
        return flops.flops_per_step(compiled, self.one_step, self.abstract, batch, counted,
                                    batch_size, texts)

    def __call__(self, k: int, carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        if k not in self.programs:
            self.compile(k, carried, batch)
        return self.fn(carried, batch)


def _rows_step(single: Any, scanned: bool, source: BatchSource, names: list[str]) -> Any:
    """``(state, what the calls take) -> (state, rows)``: ``single`` once or K times under a
    scan, each step's metrics packed into one row inside the scan's body (one scan output
    instead of one per metric), on the batches ``source`` gives. ``names`` gets the row's
    columns in order when the program is traced."""

    def one_row(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        state, metrics = single(state, batch)
        names[:] = sorted(metrics)
        return state, pack_metrics(metrics)

    return source.rows_program(one_row, scanned)


def _jit_donated(body: Any, state_sharding: TrainState | None,
                 batch_sharding: jax.sharding.NamedSharding | None, source: BatchSource) -> Any:
    """``body`` jitted with the state donated; pinned to ``state_sharding`` when there is one, so
    the donated state comes back exactly where it went in. Named ``train_steps`` in every
    mode, as profiles show it."""

    def train_steps(carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        return body(carried, batch)

    if state_sharding is None or batch_sharding is None:  # one device: nothing to pin
        return jax.jit(train_steps, donate_argnums=0)
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    return jax.jit(traced_on(batch_sharding.mesh, train_steps), donate_argnums=0,
                   in_shardings=(state_sharding, source.placed(batch_sharding, replicated)),
                   out_shardings=(state_sharding, replicated))
