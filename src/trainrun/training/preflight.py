"""What a run checks about its model and data together before it writes anything.

A batch the model cannot take (a ``.npz`` whose arrays are not named as the model reads them,
widths that do not match) would otherwise surface at the first compile as a traceback, after
the run directory exists. Tracing the model's loss on the shapes of the first batch
(``jax.eval_shape``: no compile, no device work) finds it first.
"""

from __future__ import annotations

from typing import Any

import grain
import jax

from trainrun.data import DataError
from trainrun.models import Model


def check_batch(model: Model, data: Any, params: Any, from_config: bool) -> None:
    """Refuse, on one line, a batch of ``data`` that ``model``'s loss cannot take.

    params: the abstract params (shapes and dtypes). from_config: the model was built from the
        config, so a shape error is the config's (a model passed in reports its own errors).
    """
    if not isinstance(data, grain.MapDataset):
        return  # a plain iterator: its first batch cannot be looked at without taking it
    batch = data[0]
    if not isinstance(batch, dict):
        return
    shapes = {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in batch.items()}
    described = ", ".join(f"{name} {a.dtype}{list(a.shape)}" for name, a in shapes.items())
    init_model_state = model.init_model_state
    try:
        jax.eval_shape(lambda p, b: model.loss(
            p, b, jax.random.key(0),
            None if init_model_state is None else init_model_state(jax.random.key(0))),
            params, shapes)
    except KeyError as err:
        raise DataError(f"the model ({model.name}) reads batch key {err.args[0]!r}, which the "
                        f"data does not have (its arrays: {described}); name the arrays as the "
                        "model reads them (the MLP reads x and y)") from None
    except (TypeError, ValueError) as err:
        if not from_config:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"the model ({model.name}) cannot take the data's batches "
                        f"({described}): {first}; make the model's sizes match the "
                        "data") from None
