"""Batches cut on the device (``fast/resident.py``): the calls take no host array, and a run
trains on exactly the rows, in exactly the order, the host path feeds it: the same bits."""

from __future__ import annotations

import contextlib
import io

import jax
import numpy as np
import pytest

import trainrun
from trainrun.config import load_config
from trainrun.data import batch_iterator, build_dataset
from trainrun.fast import resident
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run


class NoHostArrays(trainrun.Callback):
    """From the first call's end on, a host array handed to a jitted call (an implicit
    host-to-device copy) is an error: JAX's transfer guard, on for the rest of the run."""

    def __init__(self) -> None:
        self.guard: contextlib.AbstractContextManager[None] | None = None
        self.boundaries = 0

    def at_boundary(self, boundary: trainrun.Boundary) -> None:
        self.boundaries += 1
        if self.guard is None:
            self.guard = jax.transfer_guard_host_to_device("disallow")
            self.guard.__enter__()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)


def bits(path) -> list[bytes]:
    return [np.float32([r[n] for n in sorted(r) if n != "step"]).tobytes()
            for r in read_metrics(path / "metrics.jsonl")]


CASES = {  # batches per epoch: 1 (each step the whole set) and 8; one-step tails
    "full batch, K=1": ["steps=30"],
    "full batch, K=10, a tail call": ["steps=25", "steps_per_call=10"],
    "batch 32, K=1": ["steps=20", "data.batch_size=32"],
    "batch 32, K=4, a one-step tail": ["steps=37", "steps_per_call=4", "data.batch_size=32"],
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=list(CASES))
def test_a_run_on_device_batches_matches_the_host_path_bit_for_bit(tmp_path, monkeypatch,
                                                                     overrides):
    config = load_config("mlp", ["metrics.every=5", *overrides])
    guard = NoHostArrays()
    run(config, tmp_path / "device", out=io.StringIO(), callbacks=[guard])
    assert guard.boundaries > 2  # no call after the first took a host array
    monkeypatch.setattr(resident, "RESIDENT_MAX_BYTES", 0)  # the host path
    with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed host-to-device"):
        run(config, tmp_path / "guarded", out=io.StringIO(), callbacks=[NoHostArrays()])
    run(config, tmp_path / "host", out=io.StringIO())
    assert bits(tmp_path / "device") == bits(tmp_path / "host")
    assert (tmp_path / "device" / "checkpoints").exists()


def test_each_step_gathers_what_the_host_path_feeds_it_from_the_restored_position():
    # 8 batches an epoch: steps 11..14 of a run resumed at step 10 with the data position at
    # 13 read global batches 13..16, across an epoch boundary.
    config = load_config("mlp", ["data.batch_size=32"])
    dataset = build_dataset(config.data, seed=config.seed)
    cursor = batch_iterator(dataset)
    cursor.set_state({"next_index": 13})
    batches = resident.resident_batches(cursor, True, cursor.next_index, step=10)
    assert batches is not None and batches.offset == 3
    args = batches.args(4)
    cut = jax.jit(lambda step: batches.batch(step, args))
    for i in range(4):
        got = cut(np.int32(10 + i))
        assert {name: np.asarray(a).tobytes() for name, a in got.items()} == \
            {name: a.tobytes() for name, a in dataset[13 + i].items()}


def test_what_stays_on_the_host():
    config = load_config("mlp")
    cursor = batch_iterator(build_dataset(config.data, seed=config.seed))
    assert resident.resident_batches(cursor, True, 0, 0) is not None
    assert resident.resident_batches(cursor, False, 0, 0) is None  # a mesh of devices
    assert resident.resident_batches(iter([]), True, 0, 0) is None  # any other iterator
    shuffled = load_config("mlp", ["data.shuffle=true"])
    cursor = batch_iterator(build_dataset(shuffled.data, seed=shuffled.seed))
    assert resident.resident_batches(cursor, True, 0, 0) is None  # module docstring


@pytest.mark.parametrize("k", [1, 10])
def test_the_gather_is_not_counted_as_the_steps_work(tmp_path, monkeypatch, k):
    # K=1: the host path counts its whole one-step program (the state's packing too), the
    # device path the step alone; counted with it, the gather made the figure 3.6% larger.
    config = load_config("mlp", ["steps=20", f"steps_per_call={k}"])
    on_device = run(config, tmp_path / "device", out=io.StringIO()).flops_per_step
    monkeypatch.setattr(resident, "RESIDENT_MAX_BYTES", 0)
    on_host = run(config, tmp_path / "host", out=io.StringIO()).flops_per_step
    assert 0 < on_device <= on_host
    assert on_device == on_host or k == 1
