"""The reference chapter's synthetic regression: ``x ~ N(0, 1)`` drawn with
``jax.random.normal(jax.random.key(seed), (examples, features))``, ``y = sum(x, axis=1)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import RegressionData


def regression_arrays(cfg: RegressionData) -> dict[str, np.ndarray]:
    x = jax.random.normal(jax.random.key(cfg.seed), (cfg.examples, cfg.features))
    y = jnp.sum(x, axis=1, keepdims=True)
    return {"x": np.asarray(x), "y": np.asarray(y)}
