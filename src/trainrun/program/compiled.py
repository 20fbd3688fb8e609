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
from trainrun.platform.fast_paths import FastPaths
from trainrun.program import flops
from trainrun.program.optim import Optimizer
from trainrun.program.packing import StatePacking, packing_for
from trainrun.program.precision import Policy
from trainrun.program.resident import ResidentBatches
from trainrun.program.sharding import traced_on
from trainrun.program.state import TrainState
from trainrun.program.step import make_multi_step, make_train_step
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

    The calls take and return the state as ``carried``: the ``TrainState`` itself, or, for a
    small state on one device, its flat buffers (``packing.py``). ``carry`` and ``state``
    convert; the loop converts back only where it needs the state (checkpoints, eval)."""

    def __init__(self, model: Model, optimizer: Optimizer, steps_per_call: int,
                 watch: PhaseTimer, *, abstract: TrainState | None = None,
                 accumulate: int = 1, policy: Policy | None = None,
                 state_sharding: TrainState | None = None,
                 batch_sharding: jax.sharding.NamedSharding | None = None,
                 stream: Emit | None = None, resident: ResidentBatches | None = None,
                 fast: FastPaths | None = None):
        scanned, fast = steps_per_call > 1, fast or FastPaths()
        self.one_step = make_train_step(  # what one step computes (FLOPs per step)
            model, optimizer, accumulate=accumulate, policy=policy,
            cpu_guard_branches=scanned and fast.cpu_guard_branches)
        single = self.one_step if stream is None else streamed(self.one_step, stream)
        self.step = make_multi_step(single) if scanned else single  # metrics by name
        self.resident = resident
        self.abstract = abstract
        # Without the abstract state (a caller holding TrainStates) the calls take TrainStates.
        self.packing = (packing_for(abstract, jax.device_count())
                        if fast.state_packing and abstract is not None else None)
        body = _rows_step(single, scanned, resident)
        if self.packing is not None:
            self._carry, self._state = jax.jit(self.packing.pack), jax.jit(self.packing.unpack)
            body = _on_packed(body, self.packing)
        self.state_sharding = state_sharding
        self.fn = _jit_donated(body, state_sharding if self.packing is None else None,
                               batch_sharding, resident is not None)
        self.watch = watch
        self.programs: dict[int, Any] = {}
        self.metric_names: list[str] = []

    def carry(self, state: TrainState) -> Any:
        """``state`` as the calls take it."""
        return self._carry(state) if self.packing else state

    def state(self, carried: Any) -> TrainState:
        """The ``TrainState`` in ``carried`` (new arrays when packed: the next call may donate
        ``carried`` while they are still in use)."""
        return self._state(carried) if self.packing else carried

    def carried_shapes(self) -> Any:
        """The shapes, dtypes and placements of what the calls carry, from the abstract state:
        enough to compile a program before any state exists. The calls then find that
        executable in JAX's cache (they take arrays placed as these say)."""
        assert self.abstract is not None, "built without the abstract state"
        state = self.abstract if self.state_sharding is None else jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract,
            self.state_sharding)
        if self.packing is None:
            return state
        packed = jax.eval_shape(self.packing.pack, self.abstract)
        if self.state_sharding is None:
            return packed
        # one device: the packed buffers come out of ``carry`` whole, on the state's mesh
        mesh = jax.tree.leaves(self.state_sharding)[0].mesh
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole),
                            packed)

    def compile(self, k: int, carried: Any, batch: Batch) -> jax.stages.Compiled:
        """Compile the program for calls of ``k`` steps (before its call is timed); ``carried``
        and ``batch`` may be arrays or their shapes (``jax.ShapeDtypeStruct``)."""
        if not self.metric_names:
            state = self.abstract if self.abstract is not None else carried
            step, example = ((self.one_step, self.resident.example(1)) if self.resident
                             else (self.step, batch))
            self.metric_names = sorted(jax.eval_shape(step, state, example)[1])
        with self.watch.phase("compile"):
            self.programs[k] = self.fn.lower(carried, batch).compile()
        return self.programs[k]

    def flops_per_step(self, example: Batch, counted: Any,
                       batch_size: int) -> tuple[float | None, str | None]:
        """FLOPs of one step and their source (``flops.flops_per_step``); ``example``: a batch the
        calls took. A program that gathers its own batches (``resident.py``) would count the
        gather too, so then the step alone is lowered on a batch's shapes."""
        compiled, batch = ((self.programs, example) if self.resident is None
                           else ({}, self.resident.example(2)))
        return flops.flops_per_step(compiled, self.one_step, self.abstract, batch, counted,
                                    batch_size)

    def __call__(self, k: int, carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        if k not in self.programs:
            self.compile(k, carried, batch)
        return self.fn(carried, batch)


def _rows_step(single: Any, scanned: bool, resident: ResidentBatches | None) -> Any:
    """``(state, batch) -> (state, rows)``: ``single`` once or K times under a scan, each step's
    metrics packed into one row inside the scan's body (one scan output instead of one per
    metric); on batches cut on the device when ``resident`` holds them."""

    def one_row(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        state, metrics = single(state, batch)
        return state, pack_metrics(metrics)

    if resident is not None:  # the calls take ``resident.args``: batches cut on the device
        return _cut_on_device(one_row, resident, scanned)
    return make_multi_step(one_row) if scanned else one_row


def _on_packed(body: Any, packing: StatePacking) -> Any:
    """``body`` on a state carried as ``packing``'s flat buffers."""

    def packed_body(carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        state, rows = body(packing.unpack(carried), batch)
        return packing.pack(state), rows

    return packed_body


def _jit_donated(body: Any, state_sharding: TrainState | None,
                 batch_sharding: jax.sharding.NamedSharding | None, resident: bool) -> Any:
    """``body`` jitted with the state donated; pinned to ``state_sharding`` when there is one, so
    the donated state comes back exactly where it went in. Named ``train_steps`` in every
    mode, as profiles show it."""

    def train_steps(carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        return body(carried, batch)

    if state_sharding is None or batch_sharding is None:  # one device: nothing to pin
        return jax.jit(train_steps, donate_argnums=0)
    replicated = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
    # resident arrays: on the run's one device, as the replicated sharding says
    inputs = replicated if resident else batch_sharding
    return jax.jit(traced_on(batch_sharding.mesh, train_steps), donate_argnums=0,
                   in_shardings=(state_sharding, inputs),
                   out_shardings=(state_sharding, replicated))


def _cut_on_device(one_row: Any, resident: ResidentBatches, scanned: bool) -> Any:
    """``one_row`` on batches gathered from ``resident``'s arrays by the step counter: a call
    ``(state, resident.args(...)) -> (state, rows)`` of one step, or of as many as the args'
    length vector under a scan, each step cutting its own batch (``ResidentBatches``)."""

    def call(state: TrainState, args: Any) -> tuple[TrainState, jax.Array]:
        def step(state: TrainState, _: Any) -> tuple[TrainState, jax.Array]:
            return one_row(state, resident.batch(state.step, args))

        k = args[1].shape[0]
        if not scanned:
            return step(state, None)
        if k == 1:  # a one-step tail: as XLA computes the host path's scan of one (it drops
            state, row = step(state, None)  # the loop), not as a scan of one buffer
            return state, row[None]
        return jax.lax.scan(step, state, None, length=k)

    return call
