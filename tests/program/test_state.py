"""The state's shapes: ``abstract_state`` from the params' shapes an NNX model's adapter traced
already equals the shapes of the state its init builds, and the module is traced once."""

from __future__ import annotations

import jax
import pytest

from trainrun.config import load_config
from trainrun.models import build_model
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import _state_builder, abstract_state

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
