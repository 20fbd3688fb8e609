"""A mixture-of-experts MLP as Mixtral, Qwen2-MoE and Qwen3-MoE compute it, dropless:

    probs   = softmax(x @ router)                        float32, [tokens, experts]
    weights, chosen = top_k(probs)                       renormalised to sum 1 where asked
    y       = sum over the chosen e of  weight_e * down_e(act(gate_e(x)) * up_e(x))
            (+ sigmoid(x @ shared_gate) * shared_mlp(x), Qwen2-MoE's shared expert)

Only the routed tokens are computed: the ``tokens x k`` assignments are sorted by expert, each
expert's run padded to whole blocks of rows, and one block at a time goes through its own
expert's weights under ``lax.scan`` (a block past the last one used is skipped). XLA:CPU's
``ragged_dot`` computes every group on every row, which is what this avoids; the cost is at most
one partial block per expert (BENCHMARKS.md, "Mixture of experts").

Expert parallelism: traced under a mesh (``jax.sharding.use_abstract_mesh``) whose ``expert``
axis has more than one device, each device holds ``experts / n`` of the experts. Routing is
computed as above (XLA places it); then, under ``shard_map``, every device of an expert group
all-gathers the group's routed tokens, computes those routed to its own experts, and the partial
outputs are summed back to the tokens' devices with a reduce-scatter. Dropless, and the same
sums as on one device up to their order.

The router's statistics of each layer (``RouterStats``) let the loss add the load-balancing
term as ``transformers`` computes it over all layers at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from trainrun.config import BATCH_AXES, TransformerModel

BLOCK_ROWS = 256  # rows of routed tokens per matmul block


class RouterStats(NamedTuple):
    """Sums over one layer's tokens: ``chosen`` ``[k, experts]`` (how often each expert is the
    ``j``-th choice), ``probs`` ``[experts]`` (the router's probabilities) and ``tokens``."""

    chosen: jax.Array
    probs: jax.Array
    tokens: jax.Array

    def __add__(self, other: RouterStats) -> RouterStats:  # type: ignore[override]
        return RouterStats(self.chosen + other.chosen, self.probs + other.probs,
                           self.tokens + other.tokens)


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """``experts x sum_j,e f_je P_e``: ``f`` the share of tokens whose ``j``-th choice is
    ``e``, ``P`` the mean router probability of ``e``, both over every MoE layer's tokens
    together (``transformers``' ``load_balancing_loss_func``, without padding)."""
    experts = stats.probs.shape[-1]
    share = stats.chosen / stats.tokens
    mean_prob = stats.probs / stats.tokens
    return experts * jnp.sum(share * mean_prob[None, :])


def _param(init: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(init, axes=axes)


class Experts(nnx.Module):
    def __init__(self, cfg: TransformerModel, rngs: nnx.Rngs):
        assert cfg.experts is not None
        d, hidden, experts = cfg.d_model, cfg.expert_width, cfg.experts
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.layers)
        normal = nnx.initializers.normal
        self.k, self.renormalise, self.kind = cfg.experts_per_token, cfg.router_renormalise, cfg.mlp
        self.router = _param(normal(std)(rngs.params(), (d, experts)), ("embed", None))
        self.gate = _param(normal(std)(rngs.params(), (experts, d, hidden)),
                           ("expert", "embed", "mlp"))
        self.up = _param(normal(std)(rngs.params(), (experts, d, hidden)),
                         ("expert", "embed", "mlp"))
        self.down = _param(normal(out_std)(rngs.params(), (experts, hidden, d)),
                           ("expert", "mlp", "embed"))
        shared = cfg.shared_expert_hidden
        if shared is not None:
            self.shared_gate = _param(normal(std)(rngs.params(), (d, 1)), ("embed", None))
            self.shared_gate_proj = _param(normal(std)(rngs.params(), (d, shared)),
                                           ("embed", "mlp"))
            self.shared_up = _param(normal(std)(rngs.params(), (d, shared)), ("embed", "mlp"))
            self.shared_down = _param(normal(out_std)(rngs.params(), (shared, d)),
                                      ("mlp", "embed"))
        self.shared = shared is not None

    def _act(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x) if self.kind == "swiglu" else jax.nn.gelu(x, approximate=True)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        rows = x.reshape(-1, x.shape[-1])  # [tokens, d_model]
        logits = jnp.dot(rows, self.router[...].astype(rows.dtype),
                         preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.k)
        if self.renormalise:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        mlp = routed_mlp if _expert_devices() == 1 else expert_parallel_mlp
        y = mlp(rows, chosen, weights.astype(rows.dtype), self.gate[...], self.up[...],
                self.down[...], self._act)
        if self.shared:
            hidden = (self._act(rows @ self.shared_gate_proj[...])
                      * (rows @ self.shared_up[...]))
            y = y + jax.nn.sigmoid(rows @ self.shared_gate[...]) * (hidden @ self.shared_down[...])
        experts = probs.shape[-1]
        stats = RouterStats(jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(0),
                            probs.sum(0), jnp.float32(rows.shape[0]))
        return y.reshape(x.shape), stats


def _expert_devices() -> int:
    """The size of the ``expert`` axis of the mesh being traced under (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("expert", 1)


def expert_parallel_mlp(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array,
                        up: jax.Array, down: jax.Array, act: Callable[[jax.Array], jax.Array]
                        ) -> jax.Array:
    """``routed_mlp`` with the experts split over the mesh's ``expert`` axis: the tokens
    (split over the batch axes) are all-gathered over ``expert``, each device computes the
    assignments to its own experts, and a reduce-scatter sums the results back to the tokens'
    devices."""
    mesh = jax.sharding.get_abstract_mesh()
    split = tuple(axis for axis in BATCH_AXES if axis in mesh.shape)
    batch = P(split)

    def local(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array,
              up: jax.Array, down: jax.Array) -> jax.Array:
        # The experts' gradients are summed over the batch axes here, once, rather than
        # inside a block's branch that only some devices take (which deadlocks).
        gate, up, down = jax.lax.pcast((gate, up, down),
                                       tuple(a for a in split if a != "expert"), to="varying")
        x, chosen, weights = (jax.lax.all_gather(a, "expert", tiled=True)
                              for a in (x, chosen, weights))
        mine = gate.shape[0]
        first = jax.lax.axis_index("expert") * mine
        here = (chosen >= first) & (chosen < first + mine)
        y = routed_mlp(x, jnp.where(here, chosen - first, mine), weights, gate, up, down, act)
        return jax.lax.psum_scatter(y, "expert", tiled=True)

    experts = P("expert")
    return jax.shard_map(local, mesh=mesh, in_specs=(batch, batch, batch, experts, experts,
                                                     experts), out_specs=batch)(
        x, chosen, weights, gate, up, down)


def routed_mlp(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array,
               up: jax.Array, down: jax.Array, act: Callable[[jax.Array], jax.Array]
               ) -> jax.Array:
    """``sum_j weights[t, j] * mlp_{chosen[t, j]}(x[t])`` for ``x`` ``[tokens, d]``,
    computing each token only through the experts it chose. An assignment to expert
    ``len(gate)`` (one past the last) is skipped: another device holds that expert."""
    tokens, k = chosen.shape
    experts, d = gate.shape[0], x.shape[-1]
    routed = tokens * k
    block = min(BLOCK_ROWS, -(-routed // 8) * 8)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    expert_sorted = flat[order]
    expert_of = jnp.minimum(expert_sorted, experts - 1)
    sizes = jnp.bincount(flat, length=experts)  # skipped assignments are not counted
    starts = jnp.cumsum(sizes) - sizes
    padded = -(-sizes // block) * block
    padded_end = jnp.cumsum(padded)
    blocks = -(-(routed + experts * (block - 1)) // block)  # enough for any routing
    rows = blocks * block
    row_sorted = (padded_end[expert_of] - padded[expert_of] + jnp.arange(routed)
                  - starts[expert_of]).astype(jnp.int32)
    row_sorted = jnp.where(expert_sorted < experts, row_sorted, rows)  # skipped: no row
    row_of = jnp.zeros(routed, jnp.int32).at[order].set(row_sorted)  # each assignment's row
    assignment_of = jnp.full(rows, routed, jnp.int32).at[row_sorted].set(order, mode="drop")
    token_of_row = jnp.where(assignment_of < routed, assignment_of // k, tokens)  # pad: none
    inputs = _gather_rows(x, token_of_row, row_of.reshape(tokens, k)).reshape(blocks, block, d)
    first_rows = jnp.arange(blocks) * block
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, first_rows, side="right"),
                               experts - 1)
    used = first_rows < padded_end[-1]
    # custom_vjp's unannotated __new__ (JAX) loses the wrapped function's return type.
    out = _block_mlp(act, inputs, gate, up, down, block_expert, used)
    out = out.reshape(rows, d)  # pyright: ignore[reportAttributeAccessIssue]
    per_assignment = _gather_rows(out, row_of, assignment_of[:, None]).reshape(tokens, k, d)
    return jnp.einsum("tkd,tk->td", per_assignment, weights.astype(x.dtype))


@jax.custom_vjp
def _gather_rows(x: jax.Array, index: jax.Array, readers: jax.Array) -> jax.Array:
    """``x[index]`` (zero rows where ``index`` is out of range), whose gradient is a gather
    too: ``readers[i]`` lists the output rows that read ``x[i]`` (out of range: none), so the
    backward pass sums them instead of scattering (XLA:CPU's scatter-add is a serial loop)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _gather_rows_forward(x: jax.Array, index: jax.Array, readers: jax.Array
                         ) -> tuple[jax.Array, tuple[jax.Array, int]]:
    return _gather_rows(x, index, readers), (readers, x.shape[0])


def _gather_rows_backward(saved: tuple[jax.Array, int], grad: jax.Array
                          ) -> tuple[jax.Array, None, None]:
    readers, n = saved
    picked = jnp.take(grad, readers.reshape(-1), axis=0, mode="fill", fill_value=0)
    return picked.reshape(n, readers.shape[1], -1).sum(axis=1), None, None


_gather_rows.defvjp(_gather_rows_forward, _gather_rows_backward)


Act = Callable[[jax.Array], jax.Array]


Hidden = tuple[jax.Array, jax.Array] | None  # each block's gate and up outputs, kept or not


def _blocks(act: Act, x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
            block_expert: jax.Array, used: jax.Array, keep: bool
            ) -> tuple[jax.Array, Hidden]:
    """``down_e(act(gate_e(x[b])) * up_e(x[b]))`` with ``e = block_expert[b]`` for each block
    ``b`` of rows (``x`` ``[blocks, rows, d]``), zeros for a block not ``used``: the whole MLP
    one block at a time under ``lax.scan``; with ``keep``, each block's ``gate`` and ``up``
    outputs too, for the backward pass."""
    def one_block(_: None, item: tuple[jax.Array, jax.Array, jax.Array]
                  ) -> tuple[None, tuple[jax.Array, Hidden]]:
        xb, e, live = item

        def compute() -> tuple[jax.Array, Hidden]:
            gated, upped = xb @ gate[e], xb @ up[e]
            return (act(gated) * upped) @ down[e], (gated, upped) if keep else None

        def skipped() -> tuple[jax.Array, Hidden]:
            none = jnp.zeros_like(xb, shape=(xb.shape[0], gate.shape[-1]))
            return (jnp.zeros_like(xb, shape=(xb.shape[0], down.shape[-1])),
                    (none, none) if keep else None)

        return None, jax.lax.cond(live, compute, skipped)

    return jax.lax.scan(one_block, None, (x, block_expert, used))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_mlp(act: Act, x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
               block_expert: jax.Array, used: jax.Array) -> jax.Array:
    """The blocks' outputs (``_blocks``)."""
    return _blocks(act, x, gate, up, down, block_expert, used, keep=False)[0]


def _block_mlp_forward(act: Act, x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                       block_expert: jax.Array, used: jax.Array
                       ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """The blocks' outputs, keeping each block's ``gate`` and ``up`` outputs for the backward
    pass, as a dense MLP's autodiff keeps them."""
    out, hidden = _blocks(act, x, gate, up, down, block_expert, used, keep=True)
    assert hidden is not None
    gated, upped = hidden
    return out, (x, gated, upped, gate, up, down, block_expert, used)


def _block_mlp_backward(act: Act, saved: tuple[jax.Array, ...], grad: jax.Array
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, None, None]:
    """One block at a time again, from the hidden activations the forward pass kept; each
    expert's weight gradients are added into its slice of carried arrays, in place (the
    transpose JAX derives adds a whole zero ``[experts, ...]`` array per block instead)."""
    x, gated_all, upped_all, gate, up, down, block_expert, used = saved

    def one_block(carry: tuple[jax.Array, jax.Array, jax.Array], item: tuple[jax.Array, ...]
                  ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
        d_gate, d_up, d_down = carry
        xb, gated, upped, gb, e, live = item

        def compute() -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
            activated, act_vjp = jax.vjp(act, gated)
            d_hidden = gb @ down[e].T
            d_gated = act_vjp(d_hidden * upped)[0]
            d_upped = d_hidden * activated
            dx = d_gated @ gate[e].T + d_upped @ up[e].T
            return (d_gate.at[e].add(xb.T @ d_gated), d_up.at[e].add(xb.T @ d_upped),
                    d_down.at[e].add((activated * upped).T @ gb)), dx

        return jax.lax.cond(live, compute, lambda: (carry, jnp.zeros_like(xb)))

    zeros = (jnp.zeros_like(gate), jnp.zeros_like(up), jnp.zeros_like(down))
    (d_gate, d_up, d_down), dx = jax.lax.scan(
        one_block, zeros, (x, gated_all, upped_all, grad, block_expert, used))
    return dx, d_gate, d_up, d_down, None, None


_block_mlp.defvjp(_block_mlp_forward, _block_mlp_backward)
