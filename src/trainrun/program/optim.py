"""The Optax optimizer and learning-rate schedule a config asks for. Nothing else."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainrun.config import ConfigError, OptimizerConfig, warmup_steps

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """tx: the gradient transformation the step applies.
    schedule: update count -> learning rate; ``tx`` uses ``schedule(c)`` for its ``c``-th update
    (from 0), and the step logs that value as ``lr``."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    ema: float | None = None  # decay of the params' moving average the state keeps, if any
    # params -> a tree of bools, True where a param trains (``optimizer.trainable``); None: all
    trainable: Callable[[PyTree], PyTree] | None = None


def build_schedule(cfg: OptimizerConfig, total_steps: int | None = None) -> optax.Schedule:
    """The schedule ``cfg.schedule`` names, peaking at ``cfg.lr``.

    total_steps: the run's length: the schedule's, unless it gives ``total_steps`` of its own,
        and what a warm-up given as a fraction is a fraction of.
    """
    s, peak = cfg.schedule, cfg.lr
    total = getattr(s, "total_steps", None) or total_steps
    if s.kind in ("cosine", "wsd") and total is None:
        raise ValueError(f"schedule {s.kind!r} needs total_steps (the run's length)")
    if s.kind == "constant":
        return optax.constant_schedule(peak)
    if s.kind == "piecewise":
        return optax.piecewise_constant_schedule(
            peak, dict(zip(s.boundaries, s.scales, strict=True)))
    warmup = warmup_steps(s, total)
    if s.kind == "warmup":
        return optax.warmup_constant_schedule(s.init_lr, peak, warmup)
    if s.kind == "cosine":
        assert total is not None  # refused above
        return optax.warmup_cosine_decay_schedule(s.init_lr, peak, warmup, total,
                                                  end_value=s.end_lr)
    if s.kind == "exponential":
        return optax.warmup_exponential_decay_schedule(
            s.init_lr, peak, warmup, s.transition_steps, s.decay_rate,
            staircase=s.staircase, end_value=s.end_lr)
    assert total is not None  # wsd: refused above
    return warmup_stable_decay(s.init_lr, peak, s.end_lr, warmup,
                               round(s.decay_fraction * total), total, s.decay)


def warmup_stable_decay(init_lr: float, peak: float, end_lr: float, warmup_steps: int,
                        decay_steps: int, total_steps: int, shape: str) -> optax.Schedule:
    """Linear warmup, ``peak`` held, then a ``shape`` decay to ``end_lr`` over the last
    ``decay_steps`` (linear; cosine; sqrt: ``1 - sqrt(t)``, the cooldown of Hägele et al. 2024)."""
    decay_start = total_steps - decay_steps

    def decay(count: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.clip(count / max(decay_steps, 1), 0.0, 1.0)
        frac = {"linear": 1.0 - t, "cosine": 0.5 * (1.0 + jnp.cos(jnp.pi * t)),
                "sqrt": 1.0 - jnp.sqrt(t)}[shape]
        return end_lr + (peak - end_lr) * frac

    return optax.join_schedules(
        [optax.linear_schedule(init_lr, peak, warmup_steps), optax.constant_schedule(peak), decay],
        [warmup_steps, decay_start])


def decay_mask(params: PyTree) -> PyTree:
    """True for params that get weight decay: those with two or more dims (weight matrices,
    embeddings, conv kernels). Vectors (biases, norm scales and offsets) are left alone."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def build_optimizer(cfg: OptimizerConfig, total_steps: int | None = None) -> Optimizer:
    """``cfg``'s optimizer with its schedule, after global-norm clipping if ``cfg.clip_norm``."""
    schedule = build_schedule(cfg, total_steps)
    # A float learning rate (not the schedule) when it is constant: the same program as a
    # hand-written `optax.adam(lr)`, which is what parity with a hand loop is tested against.
    lr = cfg.lr if cfg.schedule.kind == "constant" else schedule
    if cfg.name == "adam":
        tx = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    elif cfg.name == "adamw":
        tx = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                         mask=decay_mask)
    elif cfg.name == "sgd":
        tx = optax.sgd(lr, momentum=cfg.momentum or None)
    else:
        tx = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    if cfg.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), tx)
    if cfg.trainable is not None:
        # Frozen params get a zero update (so they stay bit for bit what they were, weight
        # decay included) and no optimizer state; clipping sees the trainable gradients only.
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                   functools.partial(trainable_labels, patterns=cfg.trainable))
    trainable = (None if cfg.trainable is None
                 else functools.partial(trainable_mask, patterns=cfg.trainable))
    return Optimizer(tx=tx, schedule=schedule, ema=cfg.ema, trainable=trainable)


def trainable_mask(params: PyTree, patterns: list[str]) -> PyTree:
    """True for each param whose dotted path matches one of ``patterns`` (``trainable_labels``)."""
    return jax.tree.map(lambda label: label == "train", trainable_labels(params, patterns))


def param_name(path: tuple[Any, ...]) -> str:
    """A param's dotted path in a params tree: ``blocks.0.attn.q.kernel``."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def trainable_labels(params: PyTree, patterns: list[str]) -> PyTree:
    """"train" for each param whose dotted path matches one of ``patterns``, else "frozen"."""
    compiled = [re.compile(p) for p in patterns]
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if any(p.search(param_name(path)) for p in compiled)
        else "frozen", params)
    # (Optax also calls this on a leafless placeholder to map the state's structure.)
    if jax.tree.leaves(params) and "train" not in jax.tree.leaves(labels):
        names = [param_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        raise ConfigError(f"optimizer.trainable {patterns} matches no param, so nothing would "
                          f"train; params are named like {', '.join(names[:3])}")
    return labels
