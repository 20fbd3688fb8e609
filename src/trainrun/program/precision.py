"""Mixed precision: which dtype params are stored in, computed in and returned in, and the
dynamic loss scale that keeps float16 gradients from underflowing.

    stored params (float32 masters) ──cast──► compute dtype ──model──► loss ──cast──► output dtype
    float16: loss * scale ──grad──► grads / scale; non-finite grads halve the scale and the
    step is skipped; ``growth_interval`` finite steps in a row double it.

bfloat16 has float32's exponent range, so it needs no loss scale; float16 (max 65504, smallest
normal 6e-5) does. The policy is static (part of the program); the loss scale is state (part of
``TrainState``, so it is donated and checkpointed with the rest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def cast_floats(tree: PyTree, dtype: Any) -> PyTree:
    """Floating-point leaves of ``tree`` to ``dtype``; integer leaves (tokens, labels, counts) and
    leaves already of that dtype are returned as they are, so a float32 policy adds no op."""
    dtype = jnp.dtype(dtype)

    def cast(x: Any) -> Any:
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating) or jnp.result_type(x) == dtype:
            return x
        return jnp.asarray(x).astype(dtype)

    return jax.tree.map(cast, tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scale state. ``scale`` float32; ``good_steps`` int32, finite steps since the
    scale last changed. Without float16 compute it stays ``(1.0, 0)`` and is never used."""

    scale: jax.Array
    good_steps: jax.Array

    @staticmethod
    def create(scale: float = 1.0) -> LossScale:
        return LossScale(scale=jnp.asarray(scale, jnp.float32),
                         good_steps=jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of a run (static: they shape the compiled program).

    params: dtype the stored params (the optimizer's masters) are kept in.
    compute: dtype the model runs in; params and floating batch leaves are cast to it.
    output: dtype of the loss and aux metrics as the step receives them from the model.
    loss_scale, growth_interval, factor: dynamic loss scaling, used with float16 compute only.
    """

    params: Any = jnp.float32
    compute: Any = jnp.float32
    output: Any = jnp.float32
    loss_scale: float = 2.0**15
    growth_interval: int = 2000
    factor: float = 2.0

    @property
    def scales_loss(self) -> bool:
        return jnp.dtype(self.compute) == jnp.float16

    def initial_loss_scale(self) -> LossScale:
        return LossScale.create(self.loss_scale if self.scales_loss else 1.0)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        return cast_floats(tree, self.params)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        return cast_floats(tree, self.compute)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        return cast_floats(tree, self.output)

    def scale_loss(self, loss: jax.Array, state: LossScale) -> jax.Array:
        return loss * state.scale.astype(loss.dtype) if self.scales_loss else loss

    def unscale_grads(self, grads: PyTree, state: LossScale) -> PyTree:
        if not self.scales_loss:
            return grads
        inverse = 1.0 / state.scale
        return jax.tree.map(lambda g: (g.astype(jnp.float32) * inverse).astype(g.dtype), grads)

    def adjust(self, state: LossScale, finite: jax.Array) -> LossScale:
        """The scale for the next step: halve (down to 1) after a non-finite step; multiply by
        ``factor`` after ``growth_interval`` finite steps in a row (unless that overflows)."""
        if not self.scales_loss:
            return state
        good = state.good_steps + 1
        grow = good >= self.growth_interval
        grown = state.scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
        shrunk = jnp.maximum(state.scale / self.factor, 1.0)
        scale = jnp.where(finite, jnp.where(grow, grown, state.scale), shrunk)
        good = jnp.where(finite & ~grow, good, 0)
        return LossScale(scale=scale.astype(jnp.float32), good_steps=good.astype(jnp.int32))


def policy_from_config(cfg: Any) -> Policy:
    """The policy a config's ``precision`` section names."""
    return Policy(params=DTYPES[cfg.params], compute=DTYPES[cfg.compute],
                  output=DTYPES[cfg.output], loss_scale=cfg.loss_scale,
                  growth_interval=cfg.loss_scale_growth_interval, factor=cfg.loss_scale_factor)



# ---- what a program really computes in -------------------------------------------------------

MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul or convolution of a traced program: its primitive, its operands' dtypes and
    the user-code line that made it (as JAX's source info names it)."""

    primitive: str
    operands: tuple[str, ...]
    where: str


def equations(fn: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """Every equation of the jaxpr ``fn(*args, **kwargs)`` traces to, those of its sub-jaxprs
    (scan and while bodies, rematerialized and custom-derivative calls, gradients) included."""
    from jax.extend import core as jax_core

    def walk(jaxpr: Any) -> Iterator[Any]:
        for eqn in jaxpr.eqns:
            yield eqn
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    if isinstance(sub, jax_core.ClosedJaxpr):
                        yield from walk(sub.jaxpr)
                    elif isinstance(sub, jax_core.Jaxpr):
                        yield from walk(sub)

    return walk(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr)


def matmuls(fn: Any, *args: Any, **kwargs: Any) -> list[Matmul]:
    """Every matmul and convolution that ``fn(*args, **kwargs)`` traces to, gradients and
    scanned or rematerialized bodies included (the jaxpr is walked through every sub-jaxpr).

    A policy's promise is checked on the program, not on its outputs: under bfloat16 compute
    every entry should read ``("bfloat16", "bfloat16")``; a float32 operand marks an activation
    or a param that escaped the cast (for a module of one's own: a layer created with
    ``dtype=jnp.float32``, a float32 constant table, a ``.astype(jnp.float32)`` before a
    matmul)."""
    return [Matmul(eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars), _where(eqn))
            for eqn in equations(fn, *args, **kwargs) if eqn.primitive.name in MATMUL_PRIMITIVES]


def _where(eqn: Any) -> str:
    from jax._src import source_info_util  # no public way to find an equation's user frame

    frame = source_info_util.user_frame(eqn.source_info.traceback)
    return f"{frame.file_name}:{frame.start_line}" if frame else "?"
