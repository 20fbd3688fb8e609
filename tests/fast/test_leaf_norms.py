"""The step's norms leaf by leaf (``tpu_leafwise_norms``): the norms the plain path's
concatenation gives within float tolerance, chosen on a TPU only, and a step program that no
longer lays the tree end to end."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.fast.leaf_norms import leafwise_norm
from trainrun.fast.strategies import Strategies
from trainrun.models.transformer import make_transformer
from trainrun.platform.fast_paths import FastPaths
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state
from trainrun.program.step import global_norm, make_train_step


def test_the_norm_of_leaves_of_every_dtype_and_size_is_the_concatenations():
    keys = jax.random.split(jax.random.key(0), 4)
    tree = {"big": jax.random.normal(keys[0], (300, 77)) * 1e3,
            "tiny": jax.random.normal(keys[1], (3,)) * 1e-4,
            "half": jax.random.normal(keys[2], (5, 9)).astype(jnp.bfloat16),
            "scalar": jnp.float32(-2.5), "none": None,
            "int": jnp.arange(4)}
    exact = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                        for x in jax.tree.leaves(tree)))
    assert float(leafwise_norm(tree)) == pytest.approx(exact, rel=1e-6)
    assert float(leafwise_norm(tree)) == pytest.approx(float(global_norm(tree)), rel=1e-6)
    assert leafwise_norm(tree).dtype == jnp.float32
    assert float(leafwise_norm({})) == 0.0
    assert not np.isfinite(float(leafwise_norm({"a": jnp.array([1.0, jnp.inf])})))


def test_on_a_tpu_the_norms_are_leafwise_elsewhere_and_when_off_the_concatenation(monkeypatch):
    on, off = Strategies(FastPaths()), Strategies(FastPaths.none())
    assert on.norm() is global_norm and off.norm() is global_norm  # this CPU
    assert on.norm(backend="tpu") is leafwise_norm and on.norm(backend="gpu") is global_norm
    assert off.norm(backend="tpu") is global_norm
    only = Strategies(dataclasses.replace(FastPaths.none(), tpu_leafwise_norms=True))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert only.norm() is leafwise_norm


def _concatenations(jaxpr: jax.extend.core.Jaxpr, size: int) -> int:
    """The concatenations in ``jaxpr`` (and those it calls) with ``size`` elements or more."""
    found = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "concatenate" and eqn.outvars[0].aval.size >= size:
            found += 1
        for sub in jax.core.jaxprs_in_params(eqn.params):
            found += _concatenations(sub, size)
    return found


def test_a_step_with_leafwise_norms_never_lays_the_tree_end_to_end():
    model = make_transformer(TransformerModel(vocab=64, d_model=32, layers=2, heads=2,
                                              seq_len=16))
    optimizer = build_optimizer(OptimizerConfig(), total_steps=10)
    abstract = abstract_state(model, optimizer, 0)
    params = sum(x.size for x in jax.tree.leaves(abstract.params))
    batch = {"tokens": jax.ShapeDtypeStruct((2, 16), jnp.int32)}
    counts = {}
    for name, norm in (("plain", global_norm), ("leafwise", leafwise_norm)):
        step = make_train_step(model, optimizer, norm=norm)
        counts[name] = _concatenations(jax.make_jaxpr(step)(abstract, batch).jaxpr, params)
    assert counts == {"plain": 3, "leafwise": 0}  # grad, update and param norms
