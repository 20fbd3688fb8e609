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

LoRA (``model.lora``): each expert's gate, up and down may have its own low-rank adapter
(``ExpertAdapters``), applied inside the same blocks as a block's expert weights, low rank all
the way (``x a_e b_e``, never a dense ``a_e b_e``); the router may have one too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import CustomVJPPrimal
from jax.sharding import PartitionSpec as P

from trainrun.config import BATCH_AXES, TransformerModel
from trainrun.models.lora import LoRA

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


class ExpertAdapters(NamedTuple):
    """Each expert's adapters on gate, up and down, their ``a`` already times alpha / rank;
    one without an adapter has rank 0. ``gate_up_a`` is gate's and up's ``a`` side by side
    (``[experts, d, gate rank + up rank]``): one matmul of a block's rows for both."""

    gate_up_a: jax.Array
    gate_b: jax.Array
    up_b: jax.Array
    down_a: jax.Array
    down_b: jax.Array


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
        lora = cfg.lora

        def adapter(name: str, d_in: int, d_out: int, axes: tuple[str, str],
                    experts: int | None = None) -> LoRA | None:
            return (LoRA(d_in, d_out, lora, axes, experts)
                    if lora is not None and name in cfg.adapted else None)

        self.gate_lora = adapter("gate", d, hidden, ("embed", "mlp"), experts)
        self.up_lora = adapter("up", d, hidden, ("embed", "mlp"), experts)
        self.down_lora = adapter("down", hidden, d, ("mlp", "embed"), experts)
        self.router_lora = adapter("router", d, experts, ("embed", "expert"))

    def _act(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(x) if self.kind == "swiglu" else jax.nn.gelu(x, approximate=True)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        rows = x.reshape(-1, x.shape[-1])  # [tokens, d_model]
        logits = jnp.dot(rows, self.router[...].astype(rows.dtype),
                         preferred_element_type=jnp.float32)
        if self.router_lora is not None:
            low = rows @ self.router_lora.scaled_a().astype(rows.dtype)
            logits = logits + jnp.dot(low, self.router_lora.b[...].astype(rows.dtype),
                                      preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.k)
        if self.renormalise:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        mlp = routed_mlp if _expert_devices() == 1 else expert_parallel_mlp
        y = mlp(rows, chosen, weights.astype(rows.dtype), self.gate[...], self.up[...],
                self.down[...], self._act, self._adapters())
        if self.shared:
            hidden = (self._act(rows @ self.shared_gate_proj[...])
                      * (rows @ self.shared_up[...]))
            y = y + jax.nn.sigmoid(rows @ self.shared_gate[...]) * (hidden @ self.shared_down[...])
        experts = probs.shape[-1]
        stats = RouterStats(jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(0),
                            probs.sum(0), jnp.float32(rows.shape[0]))
        return y.reshape(x.shape), stats

    def _adapters(self) -> ExpertAdapters | None:
        """The experts' adapters for ``routed_mlp`` (rank 0 where a layer has none); None
        without any."""
        pairs = (self.gate_lora, self.up_lora, self.down_lora)
        if all(adapter is None for adapter in pairs):
            return None
        experts, d, hidden = self.gate.shape
        shapes = ((d, hidden), (d, hidden), (hidden, d))
        a, b = [], []
        for adapter, (d_in, d_out) in zip(pairs, shapes, strict=True):
            if adapter is None:
                a.append(jnp.zeros((experts, d_in, 0), self.gate.dtype))
                b.append(jnp.zeros((experts, 0, d_out), self.gate.dtype))
            else:
                a.append(adapter.scaled_a())
                b.append(adapter.b[...])
        return ExpertAdapters(jnp.concatenate(a[:2], axis=2), b[0], b[1], a[2], b[2])


def _expert_devices() -> int:
    """The size of the ``expert`` axis of the mesh being traced under (1: none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("expert", 1)


def expert_parallel_mlp(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array,
                        up: jax.Array, down: jax.Array, act: Callable[[jax.Array], jax.Array],
                        lora: ExpertAdapters | None = None) -> jax.Array:
    """``routed_mlp`` with the experts split over the mesh's ``expert`` axis: the tokens
    (split over the batch axes) are all-gathered over ``expert``, each device computes the
    assignments to its own experts, and a reduce-scatter sums the results back to the tokens'
    devices."""
    mesh = jax.sharding.get_abstract_mesh()
    split = tuple(axis for axis in BATCH_AXES if axis in mesh.shape)
    batch = P(split)

    def local(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array,
              up: jax.Array, down: jax.Array, lora: ExpertAdapters | None) -> jax.Array:
        # The experts' gradients are summed over the batch axes here, once, rather than
        # inside a block's branch that only some devices take (which deadlocks).
        gate, up, down, lora = jax.lax.pcast((gate, up, down, lora),
                                             tuple(a for a in split if a != "expert"),
                                             to="varying")
        x, chosen, weights = (jax.lax.all_gather(a, "expert", tiled=True)
                              for a in (x, chosen, weights))
        mine = gate.shape[0]
        first = jax.lax.axis_index("expert") * mine
        here = (chosen >= first) & (chosen < first + mine)
        y = routed_mlp(x, jnp.where(here, chosen - first, mine), weights, gate, up, down, act,
                       lora)
        return jax.lax.psum_scatter(y, "expert", tiled=True)

    experts = P("expert")
    adapters = None if lora is None else jax.tree.map(lambda _: experts, lora)
    return jax.shard_map(local, mesh=mesh, in_specs=(batch, batch, batch, experts, experts,
                                                     experts, adapters), out_specs=batch)(
        x, chosen, weights, gate, up, down, lora)


def routed_mlp(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array,
               up: jax.Array, down: jax.Array, act: Callable[[jax.Array], jax.Array],
               lora: ExpertAdapters | None = None) -> jax.Array:
    """``sum_j weights[t, j] * mlp_{chosen[t, j]}(x[t])`` for ``x`` ``[tokens, d]``,
    computing each token only through the experts it chose (with ``lora``, each expert's
    layers with their adapters). An assignment to expert ``len(gate)`` (one past the last) is
    skipped: another device holds that expert."""
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
    out = _block_mlp(act, inputs, gate, up, down, block_expert, used, lora)
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


def _gate_up(xb: jax.Array, gate: jax.Array, up: jax.Array, lora: ExpertAdapters | None,
             e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Expert ``e``'s gate and up outputs for the rows ``xb``, with their adapters."""
    gated, upped = xb @ gate[e], xb @ up[e]
    if lora is None:
        return gated, upped
    low = xb @ lora.gate_up_a[e]
    rank = lora.gate_b.shape[1]
    return gated + low[:, :rank] @ lora.gate_b[e], upped + low[:, rank:] @ lora.up_b[e]


def _down(hidden: jax.Array, down: jax.Array, lora: ExpertAdapters | None, e: jax.Array
          ) -> jax.Array:
    """Expert ``e``'s down projection of ``hidden``, with its adapter."""
    out = hidden @ down[e]
    return out if lora is None else out + (hidden @ lora.down_a[e]) @ lora.down_b[e]


def _blocks(act: Act, x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
            block_expert: jax.Array, used: jax.Array, lora: ExpertAdapters | None, keep: bool
            ) -> tuple[jax.Array, Hidden]:
    """``down_e(act(gate_e(x[b])) * up_e(x[b]))`` with ``e = block_expert[b]`` for each block
    ``b`` of rows (``x`` ``[blocks, rows, d]``), zeros for a block not ``used``: the whole MLP
    one block at a time under ``lax.scan``; with ``keep``, each block's ``gate`` and ``up``
    outputs too, for the backward pass."""
    def one_block(_: None, item: tuple[jax.Array, jax.Array, jax.Array]
                  ) -> tuple[None, tuple[jax.Array, Hidden]]:
        xb, e, live = item

        def compute() -> tuple[jax.Array, Hidden]:
            gated, upped = _gate_up(xb, gate, up, lora, e)
            return _down(act(gated) * upped, down, lora, e), (gated, upped) if keep else None

        def skipped() -> tuple[jax.Array, Hidden]:
            none = jnp.zeros_like(xb, shape=(xb.shape[0], gate.shape[-1]))
            return (jnp.zeros_like(xb, shape=(xb.shape[0], down.shape[-1])),
                    (none, none) if keep else None)

        return None, jax.lax.cond(live, compute, skipped)

    return jax.lax.scan(one_block, None, (x, block_expert, used))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_mlp(act: Act, x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
               block_expert: jax.Array, used: jax.Array, lora: ExpertAdapters | None
               ) -> jax.Array:
    """The blocks' outputs (``_blocks``)."""
    return _blocks(act, x, gate, up, down, block_expert, used, lora, keep=False)[0]


# Which of gate, up, down and the adapters get a gradient: () yes, None no (a frozen one,
# under stop_gradient), kept as the residuals' structure.
Wanted = tuple[tuple[()] | None, tuple[()] | None, tuple[()] | None, tuple[()] | None]
Saved = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array,
              jax.Array, ExpertAdapters | None, Wanted]


def _is_primal(leaf: Any) -> bool:
    return isinstance(leaf, CustomVJPPrimal)


def _value(primal: Any) -> Any:
    """A pytree of ``CustomVJPPrimal`` as its values."""
    return jax.tree.map(lambda p: p.value, primal, is_leaf=_is_primal)


def _perturbed(primal: Any) -> tuple[()] | None:
    """``()`` when any leaf of ``primal`` (``CustomVJPPrimal``) is differentiated, else None."""
    leaves = jax.tree.leaves(primal, is_leaf=_is_primal)
    return () if any(p.perturbed for p in leaves) else None


def _block_mlp_forward(act: Act, x: Any, gate: Any, up: Any, down: Any, block_expert: Any,
                       used: Any, lora: Any) -> tuple[jax.Array, Saved]:
    """The blocks' outputs, keeping each block's ``gate`` and ``up`` outputs for the backward
    pass, as a dense MLP's autodiff keeps them, and which weights the backward pass is to
    give gradients (frozen ones get none: LoRA's base weights)."""
    wanted: Wanted = (_perturbed(gate), _perturbed(up), _perturbed(down), _perturbed(lora))
    x, gate, up, down, block_expert, used, lora = (
        _value(a) for a in (x, gate, up, down, block_expert, used, lora))
    out, hidden = _blocks(act, x, gate, up, down, block_expert, used, lora, keep=True)
    assert hidden is not None
    gated, upped = hidden
    return out, (x, gated, upped, gate, up, down, block_expert, used, lora, wanted)


Grads = tuple[jax.Array | None, jax.Array | None, jax.Array | None, ExpertAdapters | None]


def _block_mlp_backward(act: Act, saved: Saved, grad: Any
                        ) -> tuple[jax.Array, jax.Array | None, jax.Array | None,
                                   jax.Array | None, None, None, ExpertAdapters | None]:
    """One block at a time again, from the hidden activations the forward pass kept; each
    expert's weight (and adapter) gradients are added into its slice of carried arrays, in
    place (the transpose JAX derives adds a whole zero ``[experts, ...]`` array per block
    instead). A weight the forward pass saw frozen gets no gradient, and no matmul for it."""
    x, gated_all, upped_all, gate, up, down, block_expert, used, lora, wanted = saved
    if isinstance(grad, jax.custom_derivatives.SymbolicZero):  # the output unused
        grad = jnp.zeros_like(gated_all, shape=(*x.shape[:-1], down.shape[-1]))

    def add(total: jax.Array | None, e: jax.Array, value: Callable[[], jax.Array]
            ) -> jax.Array | None:
        return None if total is None else total.at[e].add(value())

    def one_block(carry: Grads, item: tuple[jax.Array, ...]) -> tuple[Grads, jax.Array]:
        d_gate, d_up, d_down, d_lora = carry
        xb, gated, upped, gb, e, live = item

        def compute() -> tuple[Grads, jax.Array]:
            activated, act_vjp = jax.vjp(act, gated)
            hidden = activated * upped
            d_hidden = gb @ down[e].T
            if lora is not None:
                gb_low = gb @ lora.down_b[e].T
                d_hidden = d_hidden + gb_low @ lora.down_a[e].T
            d_gated = act_vjp(d_hidden * upped)[0]
            d_upped = d_hidden * activated
            dx = d_gated @ gate[e].T + d_upped @ up[e].T
            new_lora = None
            if lora is not None:
                rank = lora.gate_b.shape[1]
                d_low = jnp.concatenate([d_gated @ lora.gate_b[e].T,
                                         d_upped @ lora.up_b[e].T], axis=1)
                dx = dx + d_low @ lora.gate_up_a[e].T
                if d_lora is not None:
                    low = xb @ lora.gate_up_a[e]
                    new_lora = ExpertAdapters(
                        d_lora.gate_up_a.at[e].add(xb.T @ d_low),
                        d_lora.gate_b.at[e].add(low[:, :rank].T @ d_gated),
                        d_lora.up_b.at[e].add(low[:, rank:].T @ d_upped),
                        d_lora.down_a.at[e].add(hidden.T @ gb_low),
                        d_lora.down_b.at[e].add((hidden @ lora.down_a[e]).T @ gb))
            return (add(d_gate, e, lambda: xb.T @ d_gated), add(d_up, e, lambda: xb.T @ d_upped),
                    add(d_down, e, lambda: hidden.T @ gb), new_lora), dx

        return jax.lax.cond(live, compute, lambda: (carry, jnp.zeros_like(xb)))

    def zeros(tree: Any, want: tuple[()] | None) -> Any:
        return None if want is None or tree is None else jax.tree.map(jnp.zeros_like, tree)

    start: Grads = (zeros(gate, wanted[0]), zeros(up, wanted[1]), zeros(down, wanted[2]),
                    zeros(lora, wanted[3]))
    (d_gate, d_up, d_down, d_lora), dx = jax.lax.scan(
        one_block, start, (x, gated_all, upped_all, grad, block_expert, used))
    return dx, d_gate, d_up, d_down, None, None, d_lora


# symbolic zeros: the forward pass sees which weights are frozen (LoRA's base)
_block_mlp.defvjp(_block_mlp_forward, _block_mlp_backward, symbolic_zeros=True)
