"""scikit-learn's handwritten digits: 1,797 real 8x8 grey images in ten classes, shipped inside
the scikit-learn package (nothing is downloaded).

The split is fixed: one permutation from ``default_rng(0)`` (stable across NumPy versions), its
first 1,437 images for training and the last 360 held out, so test accuracy means the same thing
in every run.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from trainrun import extras

TEST_IMAGES = 360
SPLIT_SEED = 0


def digits_arrays() -> dict[str, dict[str, np.ndarray]]:
    """``{"train": {"x", "label"}, "eval": {...}}``; ``x`` is ``[N, 8, 8, 1]`` float32 in
    [0, 1], ``label`` int32."""
    extras.require("datasets", "data.kind=digits")
    from sklearn.datasets import load_digits
    from sklearn.utils import Bunch

    digits = cast(Bunch, load_digits())  # a Bunch: return_X_y is left False
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    label = digits.target.astype(np.int32)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(label))
    train, test = order[:-TEST_IMAGES], order[-TEST_IMAGES:]
    return {"train": {"x": x[train], "label": label[train]},
            "eval": {"x": x[test], "label": label[test]}}
