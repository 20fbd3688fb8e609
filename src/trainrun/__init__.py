"""trainrun: JAX training runs that are fast, sharded and resumable bit for bit.

The public API; everything else is internal and may move.

Importing trainrun changes one thing in the process: it adds trainrun's default XLA flags to
``XLA_FLAGS`` (the flag that makes a K-step call compute a one-step call's bits, and XLA:GPU's
deterministic mode where a GPU plugin is installed), because XLA reads them once, when JAX's
backend starts. The allocator and CPU dispatch settings are made by ``trainrun train``, by
``run()`` when JAX's backend has not started, or by ``configure_process()`` (``process.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainrun.platform.lazy_exports import lazy_exports, serve_own_reads
from trainrun.platform.process import apply_default_flags

if TYPE_CHECKING:
    from trainrun.config import ConfigError, RunConfig, load_config
    from trainrun.data import ArrayBatches, DataError
    from trainrun.errors import UserCodeFailed, UserError
    from trainrun.evaluation.language_model import LanguageModel, load
    from trainrun.evaluation.text_tokens import TextTokenizer, load_tokenizer
    from trainrun.models import Model, from_functions, from_nnx
    from trainrun.platform.process import configure_process
    from trainrun.program.state import TrainState
    from trainrun.training.callbacks import Boundary, Callback, EarlyStopping, MetricLogger
    from trainrun.training.loop import run
    from trainrun.training.summary import RunSummary

apply_default_flags()  # before anything starts JAX's backend (nothing above does)

# Each public name and the module that defines it, imported at first use: a command that needs
# no data pipeline (``--help``, ``lm-eval``) does not wait for Grain's import.
_HOME = {
    "ArrayBatches": "trainrun.data",
    "Boundary": "trainrun.training.callbacks",
    "Callback": "trainrun.training.callbacks",
    "ConfigError": "trainrun.config",
    "DataError": "trainrun.data",
    "EarlyStopping": "trainrun.training.callbacks",
    "LanguageModel": "trainrun.evaluation.language_model",
    "MetricLogger": "trainrun.training.callbacks",
    "Model": "trainrun.models",
    "RunConfig": "trainrun.config",
    "RunSummary": "trainrun.training.summary",
    "TextTokenizer": "trainrun.evaluation.text_tokens",
    "TrainState": "trainrun.program.state",
    "UserCodeFailed": "trainrun.errors",
    "UserError": "trainrun.errors",
    "configure_process": "trainrun.platform.process",
    "from_functions": "trainrun.models",
    "from_nnx": "trainrun.models",
    "load": "trainrun.evaluation.language_model",
    "load_config": "trainrun.config",
    "load_tokenizer": "trainrun.evaluation.text_tokens",
    "run": "trainrun.training.loop",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = [
    "ArrayBatches",
    "Boundary",
    "Callback",
    "ConfigError",
    "DataError",
    "EarlyStopping",
    "LanguageModel",
    "MetricLogger",
    "Model",
    "RunConfig",
    "RunSummary",
    "TextTokenizer",
    "TrainState",
    "UserCodeFailed",
    "UserError",
    "configure_process",
    "from_functions",
    "from_nnx",
    "load",
    "load_config",
    "load_tokenizer",
    "run",
]

serve_own_reads(__name__, _HOME)  # after every function above is defined
