"""trainrun: JAX training runs that are fast, sharded and resumable bit for bit.

The public API; everything else is internal and may move.
"""

from trainrun.config import ConfigError, RunConfig, load_config
from trainrun.data import ArrayBatches, DataError
from trainrun.errors import UserError
from trainrun.loop import run
from trainrun.models import Model, from_functions, from_nnx
from trainrun.state import TrainState
from trainrun.xla_flags import apply_default_flags, reuse_freed_memory, run_cpu_calls_inline

# XLA reads its flags once, when JAX's backend starts, which nothing above does; the allocator
# and dispatch settings must also come before the backend starts its threads.
apply_default_flags()
reuse_freed_memory()
run_cpu_calls_inline()

__all__ = [
    "ArrayBatches",
    "ConfigError",
    "DataError",
    "Model",
    "RunConfig",
    "TrainState",
    "UserError",
    "from_functions",
    "from_nnx",
    "load_config",
    "run",
]
