"""The Optax optimizer and learning-rate schedule a config asks for. Nothing else."""

from __future__ import annotations

import dataclasses

import optax

from trainrun.config import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """tx: the gradient transformation the step applies.
    schedule: step -> learning rate, the value ``tx`` uses at that step (logged as ``lr``)."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule


def build_optimizer(cfg: OptimizerConfig) -> Optimizer:
    schedule = optax.constant_schedule(cfg.lr)
    # A float learning rate (not the schedule) when it is constant: the same program as a
    # hand-written `optax.adam(lr)`, which is what parity with a hand loop is tested against.
    lr = cfg.lr
    if cfg.name == "adam":
        tx = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    elif cfg.name == "adamw":
        tx = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    elif cfg.name == "sgd":
        tx = optax.sgd(lr, momentum=cfg.momentum or None)
    else:
        tx = optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    return Optimizer(tx=tx, schedule=schedule)
