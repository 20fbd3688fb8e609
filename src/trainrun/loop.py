"""``run(config)``: the training run, and the only place that orders its side effects.

    build state ─► loop: next K batches ─► one jitted call (state donated)
                         ─► read the *previous* call's metrics ─► write, log
    ─► summary

Reading metrics one call late keeps the device busy: the host blocks on call ``i`` only after
call ``i+1`` is queued behind it.
"""

from __future__ import annotations

import contextlib
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

from trainrun import distributed, mfu, rundir, sharding
from trainrun.checkpoint import Checkpoints, checkpoint_dir
from trainrun.config import RunConfig
from trainrun.console import Console, make_console
from trainrun.data import batch_iterator, build_dataset, build_eval_dataset
from trainrun.errors import UserError
from trainrun.evaluation import Evaluator, eval_line
from trainrun.models import Model, build_model
from trainrun.optim import Optimizer, build_optimizer
from trainrun.packing import packing_for
from trainrun.precision import Policy, policy_from_config
from trainrun.preemption import Preemption
from trainrun.profiling import ProfileWindow
from trainrun.resume import check_config, provenance_changes, schedule_shift
from trainrun.state import TrainState, create_state
from trainrun.step import make_multi_step, make_train_step
from trainrun.stream import MetricStream, streamed
from trainrun.timing import StepTimer, Stopwatch, goodput, provenance, wall_split
from trainrun.writers import RunOutput, Table, build_output

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
    jitted call then finds that executable in JAX's cache and keeps its fast dispatch path.

    The calls take and return the state as ``carried``: the ``TrainState`` itself, or, for a
    small state on one device, its flat buffers (``packing.py``). ``carry`` and ``state``
    convert; the loop converts back only where it needs the state (checkpoints, eval)."""

    def __init__(self, model: Model, optimizer: Optimizer, steps_per_call: int,
                 watch: Stopwatch, *, abstract: TrainState | None = None,
                 accumulate: int = 1, policy: Policy | None = None,
                 state_sharding: TrainState | None = None,
                 batch_sharding: jax.sharding.Sharding | None = None,
                 stream: MetricStream | None = None):
        single = make_train_step(model, optimizer, accumulate=accumulate, policy=policy)
        self.one_step = single  # what one step computes (FLOPs per step)
        if stream is not None:  # each step's metrics also leave mid-call (metrics.stream)
            single = streamed(single, stream)
        step = single if steps_per_call == 1 else make_multi_step(single)
        self.abstract = abstract
        # Without the abstract state (a caller holding TrainStates) the calls take TrainStates.
        self.packing = packing = (packing_for(abstract, jax.device_count())
                                  if abstract is not None else None)

        def packed_step(carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
            state = packing.unpack(carried) if packing else carried
            state, metrics = step(state, batch)
            return packing.pack(state) if packing else state, pack_metrics(metrics)

        self.step = step
        if packing is not None:
            self._carry, self._state = jax.jit(packing.pack), jax.jit(packing.unpack)
            self.fn = jax.jit(packed_step, donate_argnums=0)
        elif state_sharding is None:
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

    def carry(self, state: TrainState) -> Any:
        """``state`` as the calls take it."""
        return self._carry(state) if self.packing else state

    def state(self, carried: Any) -> TrainState:
        """The ``TrainState`` in ``carried`` (new arrays when packed: the next call may donate
        ``carried`` while they are still in use)."""
        return self._state(carried) if self.packing else carried

    def compile(self, k: int, carried: Any, batch: Batch) -> None:
        """Compile the program for calls of ``k`` steps (before its call is timed)."""
        if not self.metric_names:
            state = self.abstract if self.abstract is not None else carried
            self.metric_names = sorted(jax.eval_shape(self.step, state, batch)[1])
        with self.watch.phase("compile"):
            self.programs[k] = self.fn.lower(carried, batch).compile()

    def __call__(self, k: int, carried: Any, batch: Batch) -> tuple[Any, jax.Array]:
        if k not in self.programs:
            self.compile(k, carried, batch)
        return self.fn(carried, batch)


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

    def read(self) -> Table | None:
        """Block on the pending calls and return the metrics of their steps."""
        if not self.pending:
            return None
        calls, self.pending, self.log_due = self.pending, [], False
        values = np.asarray(jax.block_until_ready(_stack([c.packed for c in calls])))
        self.timer.record(calls[0].dispatched_at, sum(c.steps for c in calls))
        return Table(calls[0].first_step + 1, self.names, values)


def run(config: RunConfig, run_dir: Path | str | None = None, *, model: Model | None = None,
        data: grain.MapDataset | Iterator[Batch] | None = None, fresh: bool = False,
        allow_config_change: bool = False, out: TextIO = sys.stdout,
        eval_data: grain.MapDataset | None = None) -> dict[str, Any]:
    """Train ``config`` and return its summary (also written to ``summary.json``).

    A run directory with a committed checkpoint resumes from its newest readable one; a run
    whose last checkpoint is at ``steps`` is finished: nothing runs, its summary is returned.
    SIGTERM or SIGINT ends the run after the current call with a checkpoint.

    model: defaults to the one ``config.model`` names.
    data: a Grain ``MapDataset`` of batches (checkpointable position) or any iterator of host
        NumPy batches; defaults to the one ``config.data`` names. With several processes, each
        process's ``data`` yields its own rows of each global batch.
    fresh: move an existing run (and its checkpoints) aside and start over.
    allow_config_change: resume even though config keys that alter the trajectory changed.
    eval_data: the held-out split that ``eval.every`` evaluates, batch ``i`` at index ``i``;
        defaults to the one ``config.data`` holds out.
    """
    # `cleanup` closes what _run opened (the checkpoint manager, letting a save in flight
    # commit) however it ends.
    with Preemption() as preemption, contextlib.ExitStack() as cleanup:
        try:
            return _run(config, run_dir, model, data, fresh, allow_config_change, out,
                        preemption, cleanup, eval_data)
        except BaseException:
            _mark_failed(Path(run_dir) if run_dir is not None else rundir.default_run_dir(config))
            raise


def _mark_failed(run_dir: Path) -> None:
    """A run this process started that raised is ``failed`` for ``trainrun runs`` (a refusal
    before it started leaves the directory's status as it was)."""
    status = rundir.read_status(run_dir) if run_dir.exists() else {}
    if status.get("status") == "running" and status.get("pid") == os.getpid():
        rundir.write_status(run_dir, "failed", status.get("step"))


def _run(config: RunConfig, run_dir: Path | str | None, model: Model | None, data: Any,
         fresh: bool, allow_config_change: bool, out: TextIO,
         preemption: Preemption, cleanup: contextlib.ExitStack,
         eval_data: grain.MapDataset | None = None) -> dict[str, Any]:
    wall_start = time.perf_counter()
    distributed.initialize(config.distributed)  # before anything asks JAX for devices
    primary = jax.process_index() == 0  # only process 0 writes files and logs
    run_dir = Path(run_dir) if run_dir is not None else rundir.default_run_dir(config)
    prov = provenance(config.digest())
    ckpt_dir = checkpoint_dir(config, run_dir)
    moved = rundir.move_runs_aside([run_dir, ckpt_dir]) if fresh and primary else []
    batch_size = _batch_size(config, data)
    unit, per_step = _throughput_unit(config, batch_size)
    console = make_console(config.steps, per_step,
                           out if primary else open(os.devnull, "w"), unit)  # noqa: SIM115
    for old, new in moved:
        console.message(f"moved the previous run aside: {old} -> {new}")
    if primary:
        rundir.check_run_dir(run_dir)
    checkpoints = cleanup.enter_context(Checkpoints(ckpt_dir, config, prov))
    latest = checkpoints.latest_step()
    if latest is not None and latest >= config.steps:
        checkpoints.close()
        console.message(rundir.finished_message(run_dir, latest, config.steps))
        return rundir.read_summary(run_dir)

    model = model or build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    policy = policy_from_config(config.precision)
    mesh = sharding.build_mesh(config.mesh)
    abstract = abstract_state(model, optimizer, config.seed, policy)
    state_sharding = sharding.state_shardings(
        mesh, abstract, model.logical_axes,
        optimizer.tx, config.mesh)
    placement = sharding.batch_placement(mesh, batch_size, stacked=config.steps_per_call > 1)
    if data is None:
        data = build_dataset(config.data, seed=config.seed, process_index=placement.rows[0],
                             process_count=placement.rows[1])
    batches = (batch_iterator(data, getattr(config.data, "prefetch_threads", 0))
               if isinstance(data, grain.MapDataset) else iter(data))
    evaluator = _evaluator(config, model, policy, mesh, eval_data)
    watch = Stopwatch()
    with watch.phase("init"):
        state = _restore_or_init(
            checkpoints, config, prov, run_dir, model, optimizer, policy, state_sharding,
            batches, allow_config_change, console, primary)
    output = build_output(
        run_dir, console, log_every=config.log_every, total_steps=config.steps,
        primary=primary, start_step=int(state.step), tensorboard=config.metrics.tensorboard,
        wandb=config.metrics.wandb, wandb_project=config.metrics.wandb_project,
        config=config.to_dict(), name=config.name)
    if primary:
        rundir.write_status(run_dir, "running", int(state.step))
    stream = MetricStream(output) if config.metrics.stream else None
    programs = CompiledSteps(model, optimizer, config.steps_per_call, watch, abstract=abstract,
                             accumulate=config.accumulate, policy=policy,
                             state_sharding=state_sharding, batch_sharding=placement.sharding,
                             stream=stream)
    profile = ProfileWindow(config.profile.steps, run_dir, enabled=primary)
    timer = StepTimer()
    console.message(f"training {model.name} for {config.steps} steps, "
                    f"{config.steps_per_call} per call -> {run_dir}")

    reader: MetricsReader | None = None
    last_metrics: dict[str, float] = {}
    nonfinite_seen = int(state.nonfinite_steps)

    def write(table: Table | None) -> None:
        """A read window's rows to the writers and console (streamed rows went already)."""
        nonlocal last_metrics, nonfinite_seen
        if table is None:
            return
        log_start = time.perf_counter()
        if stream is None:
            output.write_table(table)
        output.write_window(table.last, len(table.values), timer.per_step_s[-1], batch_size)
        counts = table.values[:, table.names.index("nonfinite_steps")]
        for i in np.flatnonzero(counts > nonfinite_seen):  # steps that were skipped
            if counts[i] > nonfinite_seen:
                nonfinite_seen = int(counts[i])
                _on_nonfinite(config, table.first + int(i), table.row(i), output, checkpoints)
        last_metrics = table.row(len(table.values) - 1)
        watch.add("log", time.perf_counter() - log_start)

    done = int(state.step)
    carried = programs.carry(state)  # the state as the calls take and donate it
    del state
    data_wait = 0.0
    stop = False
    profiling = bool(config.profile.steps) and primary
    watch.start_loop()  # the training loop's own time; its phases are taken out of it
    while done < config.steps:
        # Calls end on checkpoint steps, so the state saved is the state at that step.
        k = min(config.steps_per_call, checkpoints.until_next(done, config.steps))
        if evaluator is not None:  # and on eval steps, so eval sees the params of that step
            k = min(k, evaluator.steps_to_next(done, config.steps))
        data_start = time.perf_counter()
        if config.steps_per_call == 1:
            batch = next(batches)
        else:
            batch = stack_batches([next(batches) for _ in range(k)])
        batch = placement.put(batch)
        data_wait += time.perf_counter() - data_start
        if k not in programs.programs:  # compile time stays out of the step-time windows
            programs.compile(k, carried, batch)
            output.reset_rate(done)
        if profiling:
            profile.before_call(done, k)
        dispatched_at = time.perf_counter()
        carried, packed = programs(k, carried, batch)
        if reader is None:
            reader = MetricsReader(programs.metric_names, timer, config.log_every)
        # One call late: the calls before this one are read while this one runs.
        if reader.due():
            write(reader.read())
        reader.add(_Call(done, k, packed, dispatched_at))
        done += k
        if profiling:
            with watch.phase("profile"):
                message = profile.after_call(done, carried)
            if message:
                output.message(message)
        if evaluator is not None and evaluator.due(done, config.steps):
            write(reader.read())  # train rows first: the file stays in step order
            with watch.phase("eval"):
                # before the next call donates the state
                results = evaluator(programs.state(carried).params)
            output.write(done, results, "eval")
            output.message(eval_line(done, config.steps, results))
        stop = preemption.requested(done) and done < config.steps  # at the end: just finish
        if stop or checkpoints.due(done, config.steps):
            write(reader.read())
            output.flush()  # the metrics up to a checkpoint survive a kill right after it
            with watch.phase("checkpoint"):
                saved = checkpoints.save(done, programs.state(carried), batches, wait=stop)
            if stop:
                break
    if reader is not None:
        write(reader.read())
    profile.close()
    watch.add("data", data_wait)
    watch.end_loop()
    if stream is not None:
        jax.effects_barrier()  # every streamed row has been written
    output.close()
    with watch.phase("checkpoint"):
        checkpoints.wait()  # the final save is committed before the run reports done
    checkpoints.close()
    if stop:
        if primary:
            rundir.write_status(run_dir, "preempted", done)
        console.message(f"preempted ({preemption.reason}) after step {done}: checkpoint saved "
                        f"to {saved}. Run the same command to resume.")
        return {"preempted_at": done, "checkpoint": str(saved), "provenance": prov}

    flops = mfu.step_flops(programs.programs, programs.one_step, abstract, batch)
    peak, why = mfu.find_peak(jax.default_backend(), jax.devices()[0].device_kind,
                              jax.device_count(), config.precision.compute)
    summary = _summary(config, last_metrics, timer, watch, prov, batch_size,
                       time.perf_counter() - wall_start)
    summary.update(mfu.utilization(flops, summary["step_time_median_s"], peak, why))
    if primary:
        rundir.write_json(run_dir / rundir.SUMMARY, summary)
        rundir.write_status(run_dir, "finished", done)
    _print_summary(console, summary)
    return summary


def _evaluator(config: RunConfig, model: Model, policy: Policy, mesh: Any,
               eval_data: grain.MapDataset | None) -> Evaluator | None:
    """The eval hook (None when ``eval.every`` is 0): its batches are this process's rows of
    the held-out split, placed on the mesh as training batches are."""
    if not config.eval.every:
        return None
    size = config.eval.batch_size or config.data.batch_size
    placement = sharding.batch_placement(mesh, size, stacked=False)
    if eval_data is None:
        eval_data = build_eval_dataset(config.data, size, process_index=placement.rows[0],
                                       process_count=placement.rows[1])
    return Evaluator(model, eval_data, config.eval.every, max_batches=config.eval.batches,
                     policy=policy, put=placement.put)


def _restore_or_init(checkpoints: Checkpoints, config: RunConfig, prov: dict[str, Any],
                     run_dir: Path, model: Model, optimizer: Optimizer, policy: Policy,
                     state_sharding: TrainState, batches: Any, allow_config_change: bool,
                     console: Console, primary: bool) -> TrainState:
    """The newest readable checkpoint's state, placed by ``state_sharding`` (any mesh), with the
    data iterator set to its position; else a fresh state. Then the run's files are written
    for the step it starts at (nothing is written before a refusal)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_state(model, optimizer, config.seed, policy), state_sharding)
    changes: list[str] = []
    restored = checkpoints.restore(target, batches, lambda meta: changes.extend(
        check_config(meta["config"], config, allow_config_change, run_dir)))
    step = restored.step if restored is not None else 0
    if primary:
        rundir.start(run_dir, config, prov, step)
    for name in checkpoints.partial:
        console.message(f"removing {name}: a checkpoint whose save never finished")
    if restored is None:
        return jax.block_until_ready(
            init_state(model, optimizer, config.seed, policy, state_sharding))
    for bad, why, where in restored.moved:
        console.message(f"warning: checkpoint step {bad} cannot be read ({why}); "
                        f"moved it to {where}")
    if changes:
        console.message("warning: resuming with a changed config (--allow-config-change): "
                        + "; ".join(changes))
    shift = schedule_shift(restored.metadata["config"], config, step)
    if shift is not None:
        console.message(f"warning: the learning-rate schedule spans the run's length: with "
                        f"steps={config.steps} (was {restored.metadata['config']['steps']}) it "
                        f"differs from step {shift} on, so this run matches no uninterrupted one")
    drift = provenance_changes(restored.metadata.get("provenance", {}), prov)
    if drift:
        console.message(f"warning: the checkpoint was written with other {', '.join(drift)}; "
                        "bitwise equality with an uninterrupted run is not promised across that")
    console.message(f"resumed from step {step} ({checkpoints.directory / str(step)})")
    return restored.state


def _on_nonfinite(config: RunConfig, step: int, metrics: dict[str, float], output: RunOutput,
                  checkpoints: Checkpoints) -> None:
    """The ``nonfinite`` policy. The step already kept params and optimizer state as they were;
    ``halt`` stops the run here, before anything after this step can be saved. A save still in
    flight is of an earlier step (saves follow a read of every step before them): it is let
    finish, so the last good checkpoint is committed, not cut off by the exit."""
    if config.nonfinite == "halt":
        output.close()
        checkpoints.wait()
        checkpoints.close()
        raise NonFiniteError(
            f"step {step}: loss or gradients are not finite (loss={metrics['loss']}); the run "
            f"halted (nonfinite=halt) with the update not applied and no checkpoint written "
            f"after it. Lower optimizer.lr, set optimizer.clip_norm, check the data, or pass "
            f"nonfinite=skip to skip such steps")
    scale = f"; loss scale was {metrics['loss_scale']:g}" if "loss_scale" in metrics else ""
    output.message(f"step {step}: loss or gradients not finite; update skipped "
                    f"({int(metrics['nonfinite_steps'])} so far{scale})")


def _batch_size(config: RunConfig, data: Any) -> int:
    return getattr(data, "batch_size", None) or config.data.batch_size


def _throughput_unit(config: RunConfig, batch_size: int) -> tuple[str, int]:
    """What the console counts per second: tokens for sequence data, else examples."""
    seq_len = getattr(config.data, "seq_len", None)
    return ("tokens", batch_size * seq_len) if seq_len else ("examples", batch_size)


def _summary(config: RunConfig, last: dict[str, float], timer: StepTimer, watch: Stopwatch,
             prov: dict[str, Any], batch_size: int, wall_s: float) -> dict[str, Any]:
    step_s = timer.median_step_s()
    steps_per_s = 1.0 / step_s if step_s else None
    split = wall_split(watch, wall_s)
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
        "wall_time_split_s": split,
        "goodput": goodput(split, wall_s),
        "provenance": prov,
    }


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    p = s["provenance"]
    step_s = s["step_time_median_s"]
    split = "  ".join(f"{name} {seconds:.2f}" for name, seconds in s["wall_time_split_s"].items()
                      if seconds >= 0.005)
    if s.get("mfu") is not None:
        mfu_line = (f"{s['mfu']:.2%} of {s['peak']['flops_per_s'] / 1e9:,.1f} GFLOP/s "
                    f"({s['peak']['source']}); {s['flops_per_step']:,.0f} FLOPs/step, "
                    f"{s['flops_per_s'] / 1e9:,.2f} GFLOP/s achieved")
    else:
        mfu_line = f"not measured: {s.get('mfu_note')}"
    console.message(
        f"done: {s['steps']} steps, final loss {s['final_loss']:.8g}\n"
        f"  compile      {s['compile_s']:.3f} s (separate from step time)\n"
        f"  step time    {step_s * 1e6:,.1f} µs median over {s['timed_windows']} windows after "
        f"{s['warmup_windows']} warmup (each ended by block_until_ready)\n"
        f"  throughput   {s['steps_per_s']:,.1f} steps/s, {s['examples_per_s']:,.0f} examples/s\n"
        f"  MFU          {mfu_line}\n"
        f"  wall time    {s['wall_s']:.2f} s: {split} (goodput {s['goodput']:.1%})\n"
        f"  provenance   trainrun {p['trainrun']}, jax {p['jax']}, jaxlib {p['jaxlib']}, "
        f"{p['backend']} ({p['device_kind']}) x{p['device_count']}, "
        f"{p['process_count']} process(es), Python {p['python']}, "
        f"XLA_FLAGS={p['xla_flags']!r}, config {p['config_digest']}")
