"""Models the loop trains: plain functions or Flax NNX modules, behind one small `Model` record."""

from collections.abc import Callable
from typing import Any

from trainrun.models.adapters import Model, bind_params, from_functions, from_nnx

__all__ = ["Model", "bind_params", "build_model", "from_functions", "from_nnx"]


def build_model(cfg, preference=None, attention=None, head=None) -> Model:
    """The model a config's ``model`` section names; with a ``preference`` section, the
    transformer trained on preference pairs (``preference_transformer.py``). ``attention``: a
    transformer's ``AttentionPath``, ``head``: its language-model loss's ``HeadPath`` (None:
    the plain paths)."""
    if preference is not None:
        from trainrun.models.preference_transformer import make_preference_transformer

        return make_preference_transformer(cfg, preference)
    from trainrun.models.cnn import make_cnn
    from trainrun.models.mlp import make_mlp
    from trainrun.models.nnx_mlp import make_nnx_mlp
    from trainrun.models.resnet import make_resnet
    from trainrun.models.transformer import make_transformer

    builders: dict[str, Callable[[Any], Model]] = {
        "mlp": make_mlp, "nnx_mlp": make_nnx_mlp, "cnn": make_cnn, "resnet": make_resnet,
        "transformer": make_transformer}
    if cfg.kind == "transformer" and (attention is not None or head is not None):
        from trainrun.models.losses import PLAIN_HEAD
        from trainrun.models.transformer import AttentionPath

        return make_transformer(cfg, attention or AttentionPath(), head or PLAIN_HEAD)
    return builders[cfg.kind](cfg)
