"""A mixture-of-experts MLP layer's training step (forward and backward) against a dense gated
MLP of the same active parameters, and against the same mixture computed with every expert on
every token (the cost routing avoids).

    python benchmarks/moe.py [--tokens 4096] [--d-model 256] [--hidden 512] [--experts 8]
                             [--top 2] [--rounds 7]

    routed       trainrun's ``Experts`` layer: each token through its top-k experts only
    dense        a SwiGLU MLP of width top x hidden: the routed layer's active parameters
    all experts  the same router and weights, every expert on every token, weighted by the
                 routing (zero for the experts a token did not choose)

The three run in one process, interleaved round by round; each figure is the median of
``--rounds`` timed calls of the jitted value-and-gradient after a warm-up call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trainrun.config import TransformerModel
from trainrun.models.experts import Experts
from trainrun.platform.process import configure_process


def routed_loss(cfg: TransformerModel) -> tuple[Callable[..., jax.Array], object]:
    graphdef, params = nnx.split(Experts(cfg, nnx.Rngs(0)))

    def loss(params: object, x: jax.Array) -> jax.Array:
        y, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * y)

    return loss, params


def all_experts_loss(cfg: TransformerModel) -> tuple[Callable[..., jax.Array], object]:
    _, params = nnx.split(Experts(cfg, nnx.Rngs(0)))
    k = cfg.experts_per_token

    def loss(params: object, x: jax.Array) -> jax.Array:
        p: Any = params
        probs = jax.nn.softmax(x @ p["router"][...], axis=-1)
        weights, chosen = jax.lax.top_k(probs, k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        mix = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], chosen].set(weights)
        hidden = (jax.nn.silu(jnp.einsum("td,edh->eth", x, p["gate"][...]))
                  * jnp.einsum("td,edh->eth", x, p["up"][...]))
        y = jnp.einsum("eth,ehd,te->td", hidden, p["down"][...], mix)
        return jnp.sum(y * y)

    return loss, params


def dense_loss(cfg: TransformerModel) -> tuple[Callable[..., jax.Array], object]:
    width, key = cfg.experts_per_token * cfg.expert_width, jax.random.key(1)
    a, b, c = jax.random.split(key, 3)
    d = cfg.d_model
    params = {"gate": 0.02 * jax.random.normal(a, (d, width)),
              "up": 0.02 * jax.random.normal(b, (d, width)),
              "down": 0.02 * jax.random.normal(c, (width, d))}

    def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        y = (jax.nn.silu(x @ params["gate"]) * (x @ params["up"])) @ params["down"]
        return jnp.sum(y * y)

    return loss, params


def main() -> None:
    configure_process()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cfg = TransformerModel(vocab=256, d_model=args.d_model, heads=4, seq_len=16, mlp="swiglu",
                           experts=args.experts, experts_per_token=args.top,
                           expert_hidden=args.hidden)
    x = jax.random.normal(jax.random.key(2), (args.tokens, args.d_model))
    contenders = {"routed": routed_loss(cfg), "dense": dense_loss(cfg),
                  "all experts": all_experts_loss(cfg)}
    steps = {name: (jax.jit(jax.value_and_grad(loss)), params)
             for name, (loss, params) in contenders.items()}
    for step, params in steps.values():
        jax.block_until_ready(step(params, x))  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, (step, params) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(params, x))
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {args.tokens} tokens, "
          f"d_model {args.d_model}, {args.experts} experts of width {args.hidden}, "
          f"top {args.top}, float32; medians of {args.rounds} interleaved rounds\n")
    print("| layer | step ms | routed / this |")
    print("|---|---:|---:|")
    for name, seconds in median.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {median['routed'] / seconds:.2f} |")


if __name__ == "__main__":
    main()
