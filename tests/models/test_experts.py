"""The routed experts (``models/experts.py``) against the same mixture computed the plain way,
every expert on every token and weighted by the routing: values and gradients, the custom
backward pass (weight gradients added in place, the forward's activations reused) included."""

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
