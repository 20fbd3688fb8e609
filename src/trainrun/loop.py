"""``run(config)``: the training run, and the only place that orders its side effects.

    build state ─► loop: next K batches ─► one jitted call (state donated)
                         ─► read the *previous* call's metrics ─► write, log
    ─► summary

Reading metrics one call late keeps the device busy: the host blocks on call ``i`` only after
call ``i+1`` is queued behind it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import grain
import jax
import jax.numpy as jnp
import numpy as np

from trainrun import distributed, rundir, sharding
from trainrun.config import RunConfig
from trainrun.data import batch_iterator, build_dataset
from trainrun.errors import UserError
from trainrun.models import Model, build_model
from trainrun.optim import Optimizer, build_optimizer
from trainrun.precision import Policy, policy_from_config
from trainrun.state import TrainState, create_state
from trainrun.step import make_multi_step, make_train_step
from trainrun.timing import StepTimer, Stopwatch, provenance
from trainrun.writers import ConsoleLog, JsonlWriter

Batch = Any
MAX_PENDING_CALLS = 256  # bounds how stale unread metrics get between log points


def root_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init key, base step key) from the run's seed.

    The init key is ``jax.random.key(seed)`` itself, as a hand-written loop would use it; the
    step key is folded off it so that init and per-step draws never share a stream.
    """
    root = jax.random.key(seed)
    return root, jax.random.fold_in(root, 0x7374)  # "st"


# Init runs once, so it is compiled without XLA's algebraic simplifier: that pass would fold a
# user's `normal(k, shape) * 0.1` into the sampler's own sqrt(2) factor and round differently
# from the same function run op by op. Without it, a jitted (and sharded) init gives the very
# bits a hand-written eager `init(key)` gives.
INIT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "algsimp"}


class NonFiniteError(UserError):
    """A non-finite loss or gradient under ``nonfinite: halt``; names the step."""


def _state_builder(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None):
    policy = policy or Policy()

    def build() -> TrainState:
        init_key, base_key = root_keys(seed)  # traced: the same bits as eager, on every process
        return create_state(policy.cast_to_param(model.init(init_key)), optimizer.tx, base_key,
                            policy.initial_loss_scale())

    return build


def abstract_state(model: Model, optimizer: Optimizer, seed: int,
                   policy: Policy | None = None) -> TrainState:
    """The state's shapes and dtypes, computed without allocating it."""
    return jax.eval_shape(_state_builder(model, optimizer, seed, policy))


def init_state(model: Model, optimizer: Optimizer, seed: int, policy: Policy | None = None,
               shardings: TrainState | None = None) -> TrainState:
    """A fresh state, created where ``shardings`` puts it: each device computes only its own
    shards, so a model never has to fit whole on one device."""
    build = jax.jit(_state_builder(model, optimizer, seed, policy), out_shardings=shardings)
    return build.lower().compile(compiler_options=INIT_COMPILER_OPTIONS)()


def stack_batches(batches: list[Batch]) -> Batch:
    """K host batches -> one batch whose leaves are ``[K, ...]`` (a single host copy)."""
    return jax.tree.map(lambda *leaves: np.stack(leaves), *batches)


def pack_metrics(metrics: dict[str, jax.Array]) -> jax.Array:
    """Scalar metrics -> one float32 array ``[..., n]`` (names sorted): one transfer per call
    instead of one per metric. Counts stay exact below 2**24."""
    return jnp.stack([jnp.asarray(metrics[name], jnp.float32) for name in sorted(metrics)],
                     axis=-1)


class CompiledSteps:
    """The jitted step programs of a run: one for K steps per call, one more for a shorter tail
    call (each compiled once). Compiled ahead of time so compile time is its own figure; the
    jitted call then finds that executable in JAX's cache and keeps its fast dispatch path."""

    def __init__(self, model: Model, optimizer: Optimizer, steps_per_call: int,
                 watch: Stopwatch, *, accumulate: int = 1, policy: Policy | None = None,
                 state_sharding: TrainState | None = None,
                 batch_sharding: jax.sharding.Sharding | None = None):
        single = make_train_step(model, optimizer, accumulate=accumulate, policy=policy)
        step = single if steps_per_call == 1 else make_multi_step(single)

        def packed_step(state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
            state, metrics = step(state, batch)
            return state, pack_metrics(metrics)

        self.step = step
        if state_sharding is None:
            self.fn = jax.jit(packed_step, donate_argnums=0)
        else:  # pinned, so the donated state comes back exactly where it went in
            metrics_sharding = jax.sharding.NamedSharding(batch_sharding.mesh,
                                                          jax.sharding.PartitionSpec())
            self.fn = jax.jit(packed_step, donate_argnums=0,
                              in_shardings=(state_sharding, batch_sharding),
                              out_shardings=(state_sharding, metrics_sharding))
        self.watch = watch
        self.programs: dict[int, Any] = {}
        self.metric_names: list[str] = []

    def __call__(self, k: int, state: TrainState, batch: Batch) -> tuple[TrainState, jax.Array]:
        if k not in self.programs:
            if not self.metric_names:
                self.metric_names = sorted(jax.eval_shape(self.step, state, batch)[1])
            with self.watch.phase("compile"):
                self.programs[k] = self.fn.lower(state, batch).compile()
        return self.fn(state, batch)


@dataclasses.dataclass
class _Call:
    """A dispatched call whose metrics have not been read yet."""

    first_step: int  # updates done before this call
    steps: int
    packed: jax.Array  # [n_metrics] (K=1) or [steps, n_metrics]
    dispatched_at: float


@jax.jit
def _stack(packed: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([p.reshape(-1, p.shape[-1]) for p in packed])


class MetricsReader:
    """Reads the metrics of dispatched calls in batches, at log and sync points only.

    The pending calls' metrics are concatenated on device and fetched in one transfer, after the
    newest call is already queued, so the device never waits for the host. Each read also
    closes a timing window (see ``StepTimer``).
    """

    def __init__(self, names: list[str], timer: StepTimer, log_every: int):
        self.names = names
        self.timer = timer
        self.log_every = log_every
        self.pending: list[_Call] = []
        self.log_due = False  # a pending call includes a step to log

    def add(self, call: _Call) -> None:
        self.pending.append(call)
        end = call.first_step + call.steps
        self.log_due |= end // self.log_every > call.first_step // self.log_every

    def due(self) -> bool:
        return self.log_due or len(self.pending) >= MAX_PENDING_CALLS

    def read(self) -> list[tuple[int, dict[str, float]]]:
        """Block on the pending calls and return ``(step, metrics)`` for each of their steps."""
        if not self.pending:
            return []
        calls, self.pending, self.log_due = self.pending, [], False
        rows = np.asarray(jax.block_until_ready(_stack([c.packed for c in calls])))
        self.timer.record(calls[0].dispatched_at, sum(c.steps for c in calls))
        first = calls[0].first_step
        return [(first + i + 1, dict(zip(self.names, row.tolist(), strict=True)))
                for i, row in enumerate(rows)]


def run(config: RunConfig, run_dir: Path | str | None = None, *, model: Model | None = None,
        data: grain.MapDataset | Iterator[Batch] | None = None, fresh: bool = False,
        out: TextIO = sys.stdout) -> dict[str, Any]:
    """Train ``config`` and return its summary (also written to ``summary.json``).

    model: defaults to the one ``config.model`` names.
    data: a Grain ``MapDataset`` of batches (checkpointable position) or any iterator of host
        NumPy batches; defaults to the one ``config.data`` names. With several processes, each
        process's ``data`` yields its own rows of each global batch.
    """
    wall_start = time.perf_counter()
    distributed.initialize(config.distributed)  # before anything asks JAX for devices
    primary = jax.process_index() == 0  # only process 0 writes files and logs
    run_dir = Path(run_dir) if run_dir is not None else rundir.default_run_dir(config)
    prov = provenance(config.digest())
    moved = rundir.start_fresh(run_dir, config, prov, fresh) if primary else None
    batch_size = _batch_size(config, data)
    console = ConsoleLog(config.steps, batch_size, out if primary else open(os.devnull, "w"))  # noqa: SIM115
    if moved is not None:
        console.message(f"moved the previous run aside to {moved}")

    model = model or build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    policy = policy_from_config(config.precision)
    mesh = sharding.build_mesh(config.mesh)
    state_sharding = sharding.state_shardings(
        mesh, abstract_state(model, optimizer, config.seed, policy), model.logical_axes,
        optimizer.tx, config.mesh)
    placement = sharding.batch_placement(mesh, batch_size, stacked=config.steps_per_call > 1)
    if data is None:
        data = build_dataset(config.data, seed=config.seed, process_index=placement.rows[0],
                             process_count=placement.rows[1])
    batches = (batch_iterator(data, getattr(config.data, "prefetch_threads", 0))
               if isinstance(data, grain.MapDataset) else iter(data))
    watch = Stopwatch()
    with watch.phase("init"):
        state = jax.block_until_ready(
            init_state(model, optimizer, config.seed, policy, state_sharding))
    programs = CompiledSteps(model, optimizer, config.steps_per_call, watch,
                             accumulate=config.accumulate, policy=policy,
                             state_sharding=state_sharding, batch_sharding=placement.sharding)
    timer = StepTimer()
    jsonl = JsonlWriter(run_dir / rundir.METRICS if primary else Path(os.devnull))
    console.message(f"training {model.name} for {config.steps} steps, "
                    f"{config.steps_per_call} per call -> {run_dir}")

    reader: MetricsReader | None = None
    last_log = {"step": int(state.step), "time": time.perf_counter()}
    last_metrics: dict[str, float] = {}
    nonfinite_seen = int(state.nonfinite_steps)

    def write(rows: list[tuple[int, dict[str, float]]]) -> None:
        nonlocal last_metrics, nonfinite_seen
        for step, metrics in rows:
            jsonl.write(step, metrics)
            last_metrics = metrics
            if metrics["nonfinite_steps"] > nonfinite_seen:
                nonfinite_seen = int(metrics["nonfinite_steps"])
                _on_nonfinite(config, step, metrics, console, jsonl)
            if step % config.log_every == 0 or step == config.steps:
                now = time.perf_counter()
                rate = (step - last_log["step"]) / max(now - last_log["time"], 1e-9)
                last_log.update(step=step, time=now)
                console.line(step, metrics, rate)

    done = int(state.step)
    data_wait = 0.0
    while done < config.steps:
        k = min(config.steps_per_call, config.steps - done)
        data_start = time.perf_counter()
        if config.steps_per_call == 1:
            batch = next(batches)
        else:
            batch = stack_batches([next(batches) for _ in range(k)])
        batch = placement.put(batch)
        dispatched_at = time.perf_counter()
        data_wait += dispatched_at - data_start
        state, packed = programs(k, state, batch)
        if reader is None:
            reader = MetricsReader(programs.metric_names, timer, config.log_every)
        # One call late: the calls before this one are read while this one runs.
        if reader.due():
            write(reader.read())
        reader.add(_Call(done, k, packed, dispatched_at))
        done += k
    if reader is not None:
        write(reader.read())
    jsonl.close()
    watch.totals["data"] = data_wait

    summary = _summary(config, last_metrics, timer, watch, prov, batch_size,
                       time.perf_counter() - wall_start)
    if primary:
        rundir.write_json(run_dir / rundir.SUMMARY, summary)
    _print_summary(console, summary)
    return summary


def _on_nonfinite(config: RunConfig, step: int, metrics: dict[str, float], console: ConsoleLog,
                  jsonl: JsonlWriter) -> None:
    """The ``nonfinite`` policy. The step already kept params and optimizer state as they were;
    ``halt`` stops the run here, before anything after this step can be saved."""
    if config.nonfinite == "halt":
        jsonl.close()
        raise NonFiniteError(
            f"step {step}: loss or gradients are not finite (loss={metrics['loss']}); the run "
            f"halted (nonfinite=halt) with the update not applied and no checkpoint written "
            f"after it. Lower optimizer.lr, set optimizer.clip_norm, check the data, or pass "
            f"nonfinite=skip to skip such steps")
    scale = f"; loss scale was {metrics['loss_scale']:g}" if "loss_scale" in metrics else ""
    console.message(f"step {step}: loss or gradients not finite; update skipped "
                    f"({int(metrics['nonfinite_steps'])} so far{scale})")


def _batch_size(config: RunConfig, data: Any) -> int:
    return getattr(data, "batch_size", None) or config.data.batch_size


def _summary(config: RunConfig, last: dict[str, float], timer: StepTimer, watch: Stopwatch,
             prov: dict[str, Any], batch_size: int, wall_s: float) -> dict[str, Any]:
    step_s = timer.median_step_s()
    steps_per_s = 1.0 / step_s if step_s else None
    return {
        "final_loss": last.get("loss"),
        "steps": config.steps,
        "steps_per_call": config.steps_per_call,
        "compile_s": watch.totals.get("compile", 0.0),
        "step_time_median_s": step_s,
        "timed_windows": len(timer.steady()),
        "warmup_windows": len(timer.per_step_s) - len(timer.steady()),
        "steps_per_s": steps_per_s,
        "examples_per_s": steps_per_s * batch_size if steps_per_s else None,
        "batch_size": batch_size,
        "wall_s": wall_s,
        "time_s": dict(watch.totals),
        "provenance": prov,
    }


def _print_summary(console: ConsoleLog, s: dict[str, Any]) -> None:
    p = s["provenance"]
    step_s = s["step_time_median_s"]
    console.message(
        f"done: {s['steps']} steps, final loss {s['final_loss']:.8g}\n"
        f"  compile      {s['compile_s']:.3f} s (separate from step time)\n"
        f"  step time    {step_s * 1e6:,.1f} µs median over {s['timed_windows']} windows after "
        f"{s['warmup_windows']} warmup (each ended by block_until_ready)\n"
        f"  throughput   {s['steps_per_s']:,.1f} steps/s, {s['examples_per_s']:,.0f} examples/s\n"
        f"  provenance   trainrun {p['trainrun']}, jax {p['jax']}, jaxlib {p['jaxlib']}, "
        f"{p['backend']} ({p['device_kind']}) x{p['device_count']}, "
        f"{p['process_count']} process(es), Python {p['python']}, "
        f"XLA_FLAGS={p['xla_flags']!r}, config {p['config_digest']}")
