"""The step's norms leaf by leaf (``tpu_leafwise_norms``): the ``norm`` a step takes in place
of ``program/step.py``'s ``global_norm`` on a TPU.

``global_norm`` lays the leaves end to end and reduces once, which XLA:CPU fuses into one
kernel. XLA:TPU writes that float32 copy of the whole tree out instead, for each of the step's
three norms, and the relayout of the largest leaf into it was the costliest instruction of
GPT-2 small's compile (BENCHMARKS.md, "Tenth run on the chip"). Each leaf's sum of squares
there fuses with the op that makes the leaf. The sums differ from the concatenated one's in
their last bits: the norms agree within float tolerance, not bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any


def leafwise_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves together: each leaf's squares summed in float32, then the
    sums added."""
    total = jnp.zeros((), jnp.float32)
    for leaf in jax.tree.leaves(tree):
        total = total + jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32)))
    return jnp.sqrt(total)
