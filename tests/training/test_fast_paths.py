"""The fast paths change only speed: with every one of them off (the plain path) the default run
is still the chapter's run bit for bit, K-step calls still give one-step bits, and a killed run
still resumes bitwise; each switch really turns its path off."""

from __future__ import annotations

import io
import json
import threading

import jax
import numpy as np
import pytest
from test_parity import chapter_losses, trainrun_losses

from trainrun.config import MLPModel, OptimizerConfig, load_config
from trainrun.errors import UserError
from trainrun.fast.packing import PackedState
from trainrun.fast.strategies import Strategies
from trainrun.models.mlp import make_mlp
from trainrun.platform import fast_paths
from trainrun.platform.fast_paths import FastPaths
from trainrun.program.carried import TrainStateCarrier
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.reporting.timing import Stopwatch
from trainrun.training.loop import run


def test_the_switch_reads_all_none_or_a_list_and_refuses_an_unknown_name():
    assert fast_paths.selected({}) == FastPaths()
    assert fast_paths.selected({"TRAINRUN_FAST_PATHS": "none"}).on() == []
    chosen = fast_paths.selected({"TRAINRUN_FAST_PATHS": "state_packing, writer_thread"})
    assert chosen.on() == ["state_packing", "writer_thread"]
    with pytest.raises(UserError, match="TRAINRUN_FAST_PATHS='packing' names packing"):
        fast_paths.selected({"TRAINRUN_FAST_PATHS": "packing"})


def test_state_packing_off_carries_the_train_state_itself():
    model = make_mlp(MLPModel())
    optimizer = build_optimizer(OptimizerConfig(), total_steps=10)
    abstract = abstract_state(model, optimizer, 0)
    on, off = (CompiledSteps(model, optimizer, 1, Stopwatch(), abstract=abstract,
                             carrier=Strategies(switch).state_carrier(abstract))
               for switch in (FastPaths(), FastPaths.none()))
    assert isinstance(on.carrier, PackedState)
    assert isinstance(off.carrier, TrainStateCarrier)


def test_a_run_whose_state_is_built_op_by_op_is_the_chapter_run(tmp_path, monkeypatch):
    """The one-device TPU init (``tpu_op_by_op_init``) chosen here: no init program compiles,
    the state is built in a thread beside the step's compile, and the run trains the chapter's
    bits."""
    from trainrun.program import state
    from trainrun.training import setup

    monkeypatch.setattr(Strategies, "init_op_by_op", lambda self, devices, backend=None: True)

    def refused(lowered):
        raise AssertionError("an init program was compiled")

    for module in (state, setup):
        monkeypatch.setattr(module, "compile_init", refused)
    built_in = []
    real = state._state_builder

    def recorded(*args, **kwargs):
        build = real(*args, **kwargs)

        def counted():
            made = build()
            if not isinstance(made.step, jax.core.Tracer):  # run op by op, not traced
                built_in.append(threading.current_thread().name)
            return made

        return counted

    monkeypatch.setattr(state, "_state_builder", recorded)
    assert trainrun_losses(tmp_path).tobytes() == chapter_losses().tobytes()
    # built once, beside the step program's compile, in init's own thread
    assert len(built_in) == 1 and built_in[0].startswith("trainrun-init"), built_in


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 10, 7])
def test_the_plain_path_trains_the_fast_paths_bits(tmp_path, monkeypatch, k):
    """In-process: packing, resident batches, the guard's branches and the writer thread off."""
    fast = trainrun_losses(tmp_path / "fast", f"steps_per_call={k}")
    monkeypatch.setenv("TRAINRUN_FAST_PATHS", "none")
    plain = trainrun_losses(tmp_path / "plain", f"steps_per_call={k}")
    assert plain.tobytes() == fast.tobytes()
    recorded = {name: json.loads((tmp_path / name / "run" / "provenance.json").read_text())
                ["fast_paths"] for name in ("fast", "plain")}
    assert recorded["fast"] == fast_paths.names()  # every one of them on, and in effect
    # The run knew they were off; this process's calls stay inline (a process setting,
    # made before its backend started: conftest.py), and the provenance says so.
    assert recorded["plain"] == ["inline_cpu_calls"]


def test_a_run_refuses_an_unknown_fast_path_before_creating_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINRUN_FAST_PATHS", "everything")
    with pytest.raises(UserError, match="no fast path"):
        run(load_config("mlp", ["steps=2"]), tmp_path / "run", out=io.StringIO())
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_with_every_fast_path_off_the_cli_run_is_the_chapter_run(cli, tmp_path):
    """A process of its own, so CPU calls are dispatched asynchronously too."""
    result = cli("train", "--config", "mlp", "--run-dir", str(tmp_path / "run"),
                 "metrics.tensorboard=false", TRAINRUN_FAST_PATHS="none")
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    got = np.array([r["loss"] for r in records], np.float32)
    assert got.tobytes() == chapter_losses().tobytes()
    assert json.loads((tmp_path / "run" / "provenance.json").read_text())["fast_paths"] == []


@pytest.mark.slow
def test_with_every_fast_path_off_a_killed_run_resumes_bitwise(cli, tmp_path):
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), "steps=60",
                 "checkpoint.every=20", "metrics.tensorboard=false", TRAINRUN_FAST_PATHS="none")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "PASS" in result.stdout


def test_on_a_tpu_the_kernels_and_the_unrolled_head_are_chosen_each_by_its_switch(monkeypatch):
    import dataclasses

    import jax

    from trainrun.fast.guard import keep_if_not_branched
    from trainrun.fast.tpu_attention import SplashAttention
    from trainrun.models.losses import PLAIN_HEAD, HeadPath
    from trainrun.program.step import keep_if_not

    on, off = Strategies(FastPaths()), Strategies(FastPaths.none())
    # elsewhere (this CPU) the plain paths, every switch on or not
    for chosen in (on, off):
        assert chosen.attention().kernel is None and chosen.head_loss() == PLAIN_HEAD
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert on.attention().kernel == SplashAttention()  # blocks by the sequence's length
    assert on.head_loss() == HeadPath(unrolled=True)
    assert on.nonfinite_guard(10) is keep_if_not_branched  # one branch there (fast/guard.py)
    assert on.nonfinite_guard(1) is keep_if_not and off.nonfinite_guard(10) is keep_if_not
    assert off.attention().kernel is None and off.head_loss() == PLAIN_HEAD
    assert on.init_op_by_op(1) and not on.init_op_by_op(2) and not off.init_op_by_op(1)
    assert not on.init_op_by_op(1, backend="gpu")
    unrolled = Strategies(dataclasses.replace(FastPaths.none(), tpu_unrolled_head=True))
    assert unrolled.head_loss() == HeadPath(unrolled=True) and unrolled.attention().kernel is None
    splash = Strategies(dataclasses.replace(FastPaths.none(), tpu_splash_attention=True))
    assert isinstance(splash.attention().kernel, SplashAttention)
    assert splash.head_loss() == PLAIN_HEAD
