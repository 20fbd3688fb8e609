"""The state's shapes: ``abstract_state`` from the params' shapes an NNX model's adapter traced
already equals the shapes of the state its init builds, and the module is traced once; built
op by op, the state is the init program's bits."""

from __future__ import annotations

import jax
import pytest

from trainrun.config import load_config
from trainrun.models import build_model
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import _state_builder, abstract_state, init_state

SMALL = ["model.d_model=32", "model.layers=1"]


def _shapes(tree):
    return jax.tree.map(lambda a: (a.shape, a.dtype, a.weak_type), tree)


@pytest.mark.parametrize("name, overrides", [
    ("chat", SMALL),
    ("chat", [*SMALL, "precision.params=bfloat16", "optimizer.ema=0.99"]),
    ("chat", [*SMALL, "model.lora.rank=2"]),
    ("lm", SMALL),
    ("mlp", []),
    ("digits", []),
    ("digits_resnet", []),
])
def test_abstract_state_is_the_shapes_of_the_state_init_builds(name, overrides):
    config = load_config(name, overrides)
    model = build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    policy = policy_from_config(config.precision)
    traced = jax.eval_shape(_state_builder(model, optimizer, config.seed, policy))
    got = abstract_state(model, optimizer, config.seed, policy)
    assert jax.tree.structure(got) == jax.tree.structure(traced)
    assert _shapes(got) == _shapes(traced)


def test_the_state_shapes_of_a_transformer_trace_its_module_once(monkeypatch):
    from trainrun.models import transformer

    built = []
    real = transformer.Transformer.__init__

    def counted(self, *args, **kwargs):
        built.append(args)
        real(self, *args, **kwargs)

    monkeypatch.setattr(transformer.Transformer, "__init__", counted)
    # a module no other test builds: a process traces each module's shapes once (from_nnx)
    config = load_config("chat", [*SMALL, "model.init_std=0.0234567"])
    model = build_model(config.model)
    abstract_state(model, build_optimizer(config.optimizer, config.steps), config.seed,
                   policy_from_config(config.precision))
    assert len(built) == 1


@pytest.mark.parametrize("name, overrides", [
    ("chat", [*SMALL, "precision.params=bfloat16", "optimizer.ema=0.99"]),
    ("chat", [*SMALL, "model.lora.rank=2"]),
    ("lm", [*SMALL, "precision.compute=float16"]),
    ("digits_resnet", []),
])
def test_a_state_built_op_by_op_is_the_init_programs_bits(name, overrides):
    """The one-device TPU fast path (``tpu_op_by_op_init``) gives the state the program
    compiled without the algebraic simplifier gives: every leaf, keys and counters too."""
    import numpy as np

    config = load_config(name, overrides)
    model = build_model(config.model)
    optimizer = build_optimizer(config.optimizer, config.steps)
    policy = policy_from_config(config.precision)
    programmed = init_state(model, optimizer, config.seed, policy)
    built = init_state(model, optimizer, config.seed, policy, op_by_op=True)

    def raw(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.atleast_1d(np.asarray(x)).view(np.uint8), x.dtype

    assert jax.tree.structure(built) == jax.tree.structure(programmed)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(programmed), strict=True):
        (bytes_a, dtype_a), (bytes_b, dtype_b) = raw(a), raw(b)
        assert dtype_a == dtype_b and np.array_equal(bytes_a, bytes_b)
