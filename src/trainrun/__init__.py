"""trainrun: JAX training runs that are fast, sharded and resumable bit for bit.

The public API; everything else is internal and may move.

Importing trainrun changes one thing in the process: it adds trainrun's default XLA flags to
``XLA_FLAGS`` (the flag that makes a K-step call compute a one-step call's bits, and XLA:GPU's
deterministic mode where a GPU plugin is installed), because XLA reads them once, when JAX's
backend starts. The allocator and CPU dispatch settings are made by ``trainrun train``, by
``run()`` when JAX's backend has not started, or by ``configure_process()`` (``process.py``).
"""

from trainrun.config import ConfigError, RunConfig, load_config
from trainrun.data import ArrayBatches, DataError
from trainrun.errors import UserError
from trainrun.language_model import LanguageModel, load
from trainrun.models import Model, from_functions, from_nnx
from trainrun.platform.process import apply_default_flags, configure_process
from trainrun.program.state import TrainState
from trainrun.text_tokens import TextTokenizer, load_tokenizer
from trainrun.training.callbacks import Boundary, Callback, EarlyStopping, MetricLogger
from trainrun.training.loop import run
from trainrun.training.summary import RunSummary

apply_default_flags()  # before anything starts JAX's backend (nothing above does)

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
    "UserError",
    "configure_process",
    "from_functions",
    "from_nnx",
    "load",
    "load_config",
    "load_tokenizer",
    "run",
]
