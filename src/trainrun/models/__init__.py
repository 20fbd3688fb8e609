"""Models the loop trains: plain functions or Flax NNX modules, behind one small `Model` record."""

from trainrun.models.adapters import Model, from_functions, from_nnx

__all__ = ["Model", "build_model", "from_functions", "from_nnx"]


def build_model(cfg) -> Model:
    """The model a config's ``model`` section names."""
    from trainrun.models.mlp import make_mlp

    builders = {"mlp": make_mlp}
    return builders[cfg.kind](cfg)
