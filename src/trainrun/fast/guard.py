"""The non-finite guard as branches on CPU (``cpu_guard_branches``): the ``keep`` a scanned
step takes in place of ``program/step.py``'s ``keep_if_not``.

Inside a scan on XLA:CPU, a step that keeps its old state when the new one is not finite costs
less as a few conditionals over groups of leaves than as a select of every leaf, for a state of
many small leaves; a group stays small because XLA:CPU hands the tail of a long queue of ready
kernels to its thread pool. At a program's top level a branch costs more, and on accelerators a
branch would wait for its predicate on the host, so elsewhere the select is kept. The same bits
either way (docs/internals.md, "Fast paths"; BENCHMARKS.md, "Loop overhead").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

BRANCH_LEAVES = 4  # leaves per branch: fewer than XLA:CPU runs in the calling thread


def keep_if_not_branched(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``finite``, else ``old``: on CPU as branches over ``BRANCH_LEAVES`` leaves
    at a time, elsewhere as a select of every leaf."""

    def select() -> PyTree:
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    def branches() -> PyTree:
        new_leaves, tree = jax.tree.flatten(new)
        old_leaves = jax.tree.leaves(old)
        kept: list[Any] = []
        for i in range(0, len(new_leaves), BRANCH_LEAVES):
            group = slice(i, i + BRANCH_LEAVES)
            kept += jax.lax.cond(finite, lambda g=group: new_leaves[g],
                                 lambda g=group: old_leaves[g])
        return jax.tree.unflatten(tree, kept)

    return jax.lax.platform_dependent(cpu=branches, default=select)
