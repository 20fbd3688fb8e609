"""The routed experts (``models/experts.py``) against the same mixture computed the plain way,
every expert on every token and weighted by the routing: values and gradients, the custom
backward pass (weight gradients added in place, the forward's activations reused) included,
with each expert's LoRA adapters too, kept low rank inside the blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.models.experts import routed_mlp


def every_expert(x, chosen, weights, gate, up, down):
    experts = gate.shape[0]
    out = jnp.stack([(jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
                     for e in range(experts)], axis=1)  # [tokens, experts, d]
    mix = (jax.nn.one_hot(chosen, experts) * weights[..., None]).sum(1)  # [tokens, experts]
    return jnp.einsum("ted,te->td", out, mix)


@pytest.mark.parametrize("tokens", [64, 200])  # one partial block per expert; several blocks
def test_routed_experts_compute_and_differentiate_as_every_expert_weighted(tokens):
    experts, k, d, hidden = 4, 2, 16, 32
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (tokens, d))
    gate, up = (jax.random.normal(key, (experts, d, hidden)) / 4 for key in keys[1:3])
    down = jax.random.normal(keys[3], (experts, hidden, d)) / 6
    probs = jax.nn.softmax(jax.random.normal(keys[4], (tokens, experts)) * 2)
    weights, chosen = jax.lax.top_k(probs, k)
    chosen = chosen.at[: tokens // 2].set(jnp.array([1, 3]))  # an unbalanced routing

    def loss(f):
        return lambda x, gate, up, down: jnp.sum(
            jnp.sin(f(x, chosen, weights, gate, up, down)))

    def routed(x, chosen, weights, gate, up, down):
        return routed_mlp(x, chosen, weights, gate, up, down, jax.nn.silu)

    args = (x, gate, up, down)
    assert np.allclose(routed(x, chosen, weights, gate, up, down),
                       every_expert(x, chosen, weights, gate, up, down), atol=1e-5)
    ours = jax.jit(jax.grad(loss(routed), argnums=(0, 1, 2, 3)))(*args)
    plain = jax.grad(loss(every_expert), argnums=(0, 1, 2, 3))(*args)
    for name, a, b in zip(("x", "gate", "up", "down"), ours, plain, strict=True):
        assert np.abs(b).max() > 0.1, name
        assert np.allclose(a, b, atol=1e-5, rtol=1e-5), name


@pytest.mark.slow
def test_routed_experts_with_adapters_compute_and_differentiate_as_the_adapted_weights():
    """Each expert's adapters on gate, up and down (ranks 3, 0 and 2: a layer without one has
    rank 0) give what the expert weights ``W + A B`` give, values and gradients, the adapters'
    own included."""
    from trainrun.models.experts import ExpertAdapters

    tokens, experts, k, d, hidden = 200, 4, 2, 16, 32
    keys = iter(jax.random.split(jax.random.key(1), 12))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) / 4

    x, gate, up, down = (normal(tokens, d), normal(experts, d, hidden),
                         normal(experts, d, hidden), normal(experts, hidden, d))
    gate_a, gate_b = normal(experts, d, 3), normal(experts, 3, hidden)
    up_a, up_b = normal(experts, d, 0), normal(experts, 0, hidden)
    down_a, down_b = normal(experts, hidden, 2), normal(experts, 2, d)
    weights, chosen = jax.lax.top_k(jax.nn.softmax(normal(tokens, experts) * 8), k)
    args = (x, gate, up, down, gate_a, gate_b, down_a, down_b)

    def routed(x, gate, up, down, gate_a, gate_b, down_a, down_b):
        lora = ExpertAdapters(jnp.concatenate([gate_a, up_a], axis=2), gate_b, up_b, down_a,
                              down_b)
        return jnp.sum(jnp.sin(routed_mlp(x, chosen, weights, gate, up, down, jax.nn.silu,
                                          lora)))

    def merged(x, gate, up, down, gate_a, gate_b, down_a, down_b):
        return jnp.sum(jnp.sin(every_expert(x, chosen, weights, gate + gate_a @ gate_b,
                                            up + up_a @ up_b, down + down_a @ down_b)))

    assert abs(float(routed(*args)) - float(merged(*args))) < 1e-4
    unadapted = jnp.sum(jnp.sin(every_expert(x, chosen, weights, gate, up, down)))
    assert abs(float(routed(*args)) - float(unadapted)) > 0.1  # the adapters count
    ours = jax.jit(jax.grad(routed, argnums=tuple(range(8))))(*args)
    plain = jax.grad(merged, argnums=tuple(range(8)))(*args)
    names = ("x", "gate", "up", "down", "gate_a", "gate_b", "down_a", "down_b")
    for name, a, b in zip(names, ours, plain, strict=True):
        assert np.abs(b).max() > 0.1, name
        assert np.allclose(a, b, atol=2e-5, rtol=1e-5), name


@pytest.mark.slow
def test_the_experts_adapters_stay_low_rank_inside_the_blocks():
    """The adapters are applied as ``(x a_e) b_e`` on each block's rows: no matmul of the
    program contracts a rank to make a dense ``[d, hidden]`` (or ``[experts, d, hidden]``)
    weight, and the blocks' loop holds the adapters' rank-wide matmuls."""
    from trainrun.config import LoraConfig, TransformerModel
    from trainrun.models import build_model

    rank = 3
    cfg = TransformerModel(vocab=32, d_model=16, layers=1, heads=2, seq_len=8, mlp="swiglu",
                           experts=4, expert_hidden=24,
                           lora=LoraConfig(rank=rank, targets=("all-linear",)))
    model = build_model(cfg)
    params = model.init(jax.random.key(0))
    batch = {"tokens": np.zeros((2, 9), np.int32)}
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: model.loss(p, batch, jax.random.key(0))[0]))(
        params)

    dots: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]] = []

    def visit(jaxpr, in_loop):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (lhs, rhs), out = (v.aval.shape for v in eqn.invars), eqn.outvars[0].aval.shape
                dots.append((lhs, rhs, out, in_loop))
            for sub in jax.core.jaxprs_in_params(eqn.params):
                visit(sub, in_loop or eqn.primitive.name == "scan")

    visit(jaxpr.jaxpr, False)
    dense = [d for d in dots if sorted(d[2][-2:]) == [16, 24] and rank in d[0] + d[1]
             and d[0][-1] == rank]
    assert not dense, dense
    assert any(d[3] and d[2][-1] == 2 * rank for d in dots)  # x @ [a_gate | a_up] per block
    assert any(d[3] and d[0][-1] == rank and d[2][-1] == 16 for d in dots)  # (h a_down) b_down


@pytest.mark.slow
def test_frozen_expert_weights_get_no_gradient_matmuls():
    """Under LoRA the experts' own weights are frozen (``stop_gradient``): the backward pass
    leaves out their three weight-gradient matmuls and gives the inputs and adapters the same
    gradients."""
    from trainrun.models.experts import ExpertAdapters

    tokens, experts, d, hidden, rank = 32, 4, 8, 16, 2
    keys = iter(jax.random.split(jax.random.key(2), 12))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) / 4

    x, gate, up, down = (normal(tokens, d), normal(experts, d, hidden),
                         normal(experts, d, hidden), normal(experts, hidden, d))
    weights, chosen = jax.lax.top_k(jax.nn.softmax(normal(tokens, experts)), 2)
    lora = ExpertAdapters(normal(experts, d, 2 * rank), normal(experts, rank, hidden),
                          normal(experts, rank, hidden), normal(experts, hidden, rank),
                          normal(experts, rank, d))

    def loss(x, gate, up, down, lora, frozen):
        if frozen:
            gate, up, down = (jax.lax.stop_gradient(w) for w in (gate, up, down))
        return jnp.sum(jnp.sin(routed_mlp(x, chosen, weights, gate, up, down, jax.nn.silu,
                                          lora)))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
    args = (x, gate, up, down, lora)
    trained, frozen = (jax.jit(grad, static_argnums=5)(*args, f) for f in (False, True))
    assert all(not np.any(g) for g in frozen[1:4])
    for a, b in zip(jax.tree.leaves((trained[0], trained[4])),
                    jax.tree.leaves((frozen[0], frozen[4])), strict=True):
        np.testing.assert_array_equal(a, b)

    def matmuls(frozen: bool) -> int:
        return str(jax.make_jaxpr(lambda *a: grad(*a, frozen))(*args)).count("dot_general")

    assert matmuls(False) - matmuls(True) == 3
