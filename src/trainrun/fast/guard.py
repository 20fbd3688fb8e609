"""The non-finite guard as branches (``guard_branches``): the ``keep`` a scanned step takes in
place of ``program/step.py``'s ``keep_if_not``, grouped as the backend runs branches best.

The select of every leaf reads the new state and the old one and writes a third, after the
optimizer has written the new one: each step passes over the whole state twice more. A
conditional instead hands on one of the two as it is. On XLA:CPU, inside a scan, a few
conditionals over groups of leaves cost less than the select for a state of many small leaves;
a group stays small because XLA:CPU hands the tail of a long queue of ready kernels to its
thread pool. On a TPU one conditional over the whole state was measured slower than the
select, and held more memory (BENCHMARKS.md, "Seventh run on the chip"); at a program's top
level a branch costs more, and on a GPU a branch waits for its predicate on the host: so
everywhere but XLA:CPU the select is kept. The same bits either way (docs/internals.md, "Fast
paths"; BENCHMARKS.md, "Loop overhead").
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from trainrun.program.step import KeepIfNot

PyTree = Any

CPU_BRANCH_LEAVES = 4  # leaves per branch on CPU: fewer than XLA:CPU runs in the calling thread


def branches_of(leaves_per_branch: int) -> KeepIfNot:
    """``new`` where ``finite``, else ``old``, as one conditional per ``leaves_per_branch``
    leaves, on any backend."""

    def keep(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
        new_leaves, tree = jax.tree.flatten(new)
        old_leaves = jax.tree.leaves(old)
        kept: list[Any] = []
        for i in range(0, len(new_leaves), leaves_per_branch):
            group = slice(i, i + leaves_per_branch)
            kept += jax.lax.cond(finite, lambda g=group: new_leaves[g],
                                 lambda g=group: old_leaves[g])
        return jax.tree.unflatten(tree, kept)

    return keep


def keep_if_not_branched(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``finite``, else ``old``: on CPU as branches over ``CPU_BRANCH_LEAVES``
    leaves at a time, elsewhere as a select of every leaf."""

    def select() -> PyTree:
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    return jax.lax.platform_dependent(
        cpu=lambda: branches_of(CPU_BRANCH_LEAVES)(finite, new, old), default=select)
