"""A small state crossing the jit boundary packed: exact round trip, used only where it pays,
and the very same training bits as the state passed leaf by leaf."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import load_config
from trainrun.fast import packing
from trainrun.fast.packing import StatePacking, packing_for
from trainrun.models import build_model
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state, init_state
from trainrun.reporting.sinks.jsonl import read_metrics
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
    many = [jax.ShapeDtypeStruct((4,), jnp.float32)] * (packing.PACK_MAX_LEAVES + 1)
    assert packing_for(many, 1) is None  # small, but the unpacking would compile for long


@pytest.mark.slow
def test_packed_and_unpacked_runs_train_the_same_bits(tmp_path, monkeypatch):
    overrides = ["steps=40", "steps_per_call=4", "metrics.every=20", "checkpoint.every=20"]
    run(load_config("mlp", overrides), tmp_path / "packed", out=io.StringIO())
    monkeypatch.setattr(packing, "PACK_MAX_BYTES", 0)  # every state passed leaf by leaf
    assert packing_for(mlp_state()[0], 1) is None
    run(load_config("mlp", overrides), tmp_path / "leaves", out=io.StringIO())
    packed, leaves = (read_metrics(tmp_path / name / METRICS) for name in ("packed", "leaves"))
    assert len(packed) == 40 and packed == leaves  # every metric of every step, exactly
