"""A small state crossing the jit boundary packed: exact round trip, used only where it pays,
and the very same training bits as the state passed leaf by leaf."""

import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import load_config
from trainrun.data import build_dataset
from trainrun.models import build_model
from trainrun.program import packing
from trainrun.program.compiled import CompiledSteps
from trainrun.program.optim import build_optimizer
from trainrun.program.packing import StatePacking, packing_for
from trainrun.program.resident import ResidentBatches
from trainrun.program.state import abstract_state, init_state
from trainrun.reporting.timing import Stopwatch
from trainrun.reporting.writers import read_metrics
from trainrun.rundir import METRICS
from trainrun.training.loop import run


def mlp_state():
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    return (abstract_state(model, optimizer, config.seed),
            init_state(model, optimizer, config.seed))


def test_pack_then_unpack_gives_back_every_leaf_exactly():
    # On CPU each slice is ordered after the previous leaf through its first element's bits:
    # a NaN, an infinity, a negative zero or a bool there must come back as it went in.
    tree = {"w": jnp.array([[np.nan, 1, 2], [3, 4, 5]], jnp.float32), "step": jnp.int32(7),
            "key": jax.random.key_data(jax.random.key(3)),
            "b": jnp.array([np.inf, 1, 1, 1], jnp.bfloat16), "empty": jnp.zeros(0, jnp.float32),
            "count": jnp.array([1, 2], jnp.int32), "scale": jnp.float32(-0.0),
            "flag": jnp.array([True, False])}
    layout = StatePacking(jax.eval_shape(lambda: tree))
    packed = jax.jit(layout.pack)(tree)
    assert sorted(packed) == ["bfloat16", "bool", "float32", "int32", "uint32"]
    assert packed["float32"].shape == (7,) and packed["int32"].shape == (3,)
    back = jax.jit(layout.unpack)(packed)
    for name, leaf in tree.items():
        assert back[name].dtype == leaf.dtype and back[name].shape == leaf.shape
        assert np.asarray(back[name]).tobytes() == np.asarray(leaf).tobytes()


def test_packed_only_on_one_device_and_for_a_small_state():
    abstract, _ = mlp_state()
    assert isinstance(packing_for(abstract, 1), StatePacking)  # 18 leaves, 3.9 KB
    assert packing_for(abstract, 2) is None  # a sharded state keeps its layout per array
    big = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
           "b": jax.ShapeDtypeStruct((1024,), jnp.float32)}
    assert packing_for(big, 1) is None  # 4 MB: its arithmetic, not its dispatch, is the cost


def test_packed_and_unpacked_runs_train_the_same_bits(tmp_path, monkeypatch):
    overrides = ["steps=40", "steps_per_call=4", "log_every=20", "checkpoint.every=20"]
    run(load_config("mlp", overrides), tmp_path / "packed", out=io.StringIO())
    monkeypatch.setattr(packing, "PACK_MAX_BYTES", 0)  # every state passed leaf by leaf
    assert packing_for(mlp_state()[0], 1) is None
    run(load_config("mlp", overrides), tmp_path / "leaves", out=io.StringIO())
    packed, leaves = (read_metrics(tmp_path / name / METRICS) for name in ("packed", "leaves"))
    assert len(packed) == 40 and packed == leaves  # every metric of every step, exactly


def pool_thread_sleeps() -> list[int]:
    """Voluntary context switches so far of each of XLA:CPU's pool threads (Linux ``/proc``)."""
    sleeps = []
    for task in Path("/proc/self/task").iterdir():
        if "XLAEigen" in (task / "comm").read_text():
            status = (task / "status").read_text().splitlines()
            sleeps.append(int(next(line for line in status
                                   if line.startswith("voluntary_ctxt_switches")).split()[1]))
    return sleeps


@pytest.mark.skipif(jax.default_backend() != "cpu" or not Path("/proc/self/task").exists(),
                    reason="XLA:CPU's thread pool, seen through Linux /proc")
@pytest.mark.parametrize("k", [1, 10, 100])
def test_a_call_of_the_step_program_runs_in_the_calling_thread(k):
    # A pool thread woken by a call sleeps again after it: with the state's slices
    # independent at the program's start (or K batches gathered in one large kernel), each
    # call woke one or both pool threads (about 2 switches a call at K=10 and K=100).
    config = load_config("mlp")
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    resident = ResidentBatches(build_dataset(config.data, seed=config.seed), 0)
    programs = CompiledSteps(model, optimizer, k, Stopwatch(), resident=resident,
                             abstract=abstract_state(model, optimizer, config.seed))
    carried = programs.carry(init_state(model, optimizer, config.seed))
    for _ in range(3):  # compiled, and the pool idle again
        carried, rows = programs(k, carried, resident.args(k))
        np.asarray(rows)
    before = pool_thread_sleeps()
    assert before  # the pool is there to watch
    for _ in range(50):
        carried, rows = programs(k, carried, resident.args(k))
        np.asarray(rows)
    assert sum(pool_thread_sleeps()) - sum(before) <= 5  # was 50-100 in 50 calls
