"""The optional parts of trainrun and the extra that installs each.

    extra          package        what needs it
    report         matplotlib     trainrun report, trainrun compare
    datasets       scikit-learn   data.kind=digits (the 8x8 digits ship inside scikit-learn)
    tensorboard    tensorboardX   metrics.tensorboard (on by default where it is installed)
    wandb          wandb          metrics.wandb=offline or online
    huggingface    safetensors    init.from a Hugging Face model or .safetensors, trainrun export
    cloud          gcsfs, s3fs    gs:// and s3:// locations (run directories, data, init.from)
    eval           lm-eval        trainrun lm-eval, the lm-evaluation-harness model trainrun
    bench          torch          the benchmarks

A training run needs none of them. A feature whose package is missing stops with one line that
names the ``pip install`` to run (``MissingExtra``: the CLI exits 2), before anything is written.
"""

from __future__ import annotations

import importlib.util

from trainrun.errors import UserError

# extra -> the modules it installs (those trainrun imports)
MODULES: dict[str, tuple[str, ...]] = {
    "report": ("matplotlib",), "datasets": ("sklearn",), "tensorboard": ("tensorboardX",),
    "wandb": ("wandb",), "huggingface": ("safetensors",), "cloud": ("gcsfs", "s3fs"),
    "eval": ("lm_eval",), "bench": ("torch",)}


class MissingExtra(UserError):
    """A feature whose package is not installed; the message names the extra that installs it."""


def installed(extra: str) -> bool:
    """Whether ``extra``'s packages can be imported (found, not imported: no import cost)."""
    try:
        return all(importlib.util.find_spec(module) is not None for module in MODULES[extra])
    except (ImportError, ValueError):  # hidden (sys.modules[name] = None) or a broken install
        return False


def message(extra: str, feature: str) -> str:
    """The one line a missing extra is reported with."""
    return f"{feature} needs the {extra} extra: pip install 'trainrun[{extra}]'"


def require(extra: str, feature: str) -> None:
    """Raise ``MissingExtra`` naming ``feature`` unless ``extra``'s package is installed.

    Example:
        >>> require("report", "trainrun report")  # doctest: +SKIP
        MissingExtra: trainrun report needs the report extra: pip install 'trainrun[report]'
    """
    if not installed(extra):
        raise MissingExtra(message(extra, feature))
