"""Reading a run's newest checkpoint (``sample``, ``export``, ``trainrun.load``): the params
alone leave the optimizer's state unread; where Orbax's record of a step is damaged, random
bytes are passed over, a record Orbax cannot take is one line naming it."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from trainrun.checkpointing import integrity
from trainrun.checkpointing.reader import (
    RunReadError,
    latest_params,
    latest_state,
    saved_config,
)
from trainrun.config import load_config
from trainrun.training.loop import run


def test_the_params_alone_are_read_without_the_optimizers_state(tmp_path):
    """What samples, scores or exports a run reads its params, not the Adam moments beside
    them (twice the params' size): those leaves come back unread, the rest as a full read
    gives them, bit for bit."""
    run_dir = tmp_path / "run"
    run(load_config("mlp", ["steps=3", "checkpoint.every=3", "metrics.tensorboard=false",
                            "optimizer.name=adamw", "optimizer.ema=0.9"]),
        run_dir, out=io.StringIO())
    config = saved_config(run_dir)
    step, full = latest_state(run_dir, config)
    step_alone, alone = latest_state(run_dir, config, optimizer_state=False)
    assert step == step_alone == 3
    moments = jax.tree.leaves(full.opt_state)
    assert sum(x.size for x in moments) >= 2 * sum(x.size for x in jax.tree.leaves(full.params))
    unread = jax.tree.leaves(alone.opt_state, is_leaf=lambda x: x is ocp.PLACEHOLDER)
    assert len(unread) == len(moments) and all(x is ocp.PLACEHOLDER for x in unread)

    def same(a, b):
        leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
        return len(leaves_a) == len(leaves_b) > 0 and all(
            np.asarray(x).tobytes() == np.asarray(y).tobytes()
            for x, y in zip(leaves_a, leaves_b, strict=True))

    assert same(alone.params, full.params) and same(alone.ema, full.ema)
    assert same(alone.step, full.step) and same(alone.key_data, full.key_data)
    step_params, params = latest_params(run_dir, config)
    assert step_params == 3 and same(params, full.params)


def test_a_step_record_orbax_cannot_take_is_one_line_naming_it(tmp_path):
    """Before, a JSON object Orbax does not take in a step's _CHECKPOINT_METADATA stopped every
    read of the run with Orbax's ValueError traceback."""
    run_dir = tmp_path / "run"
    run(load_config("mlp", ["steps=2", "checkpoint.every=1", "metrics.tensorboard=false"]),
        run_dir, out=io.StringIO())
    config = saved_config(run_dir)
    record = run_dir / "checkpoints" / "1" / integrity.STEP_RECORD
    record.write_bytes(b"\x93garbage{")  # Orbax goes without it: the read goes on
    assert latest_params(run_dir, config)[0] == 2
    record.write_text(json.dumps({"item_handlers": 5}))
    with pytest.raises(RunReadError) as refused:
        latest_params(run_dir, config)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"{record.parent}: _CHECKPOINT_METADATA, Orbax's record of step 1, "
                           "is not one Orbax reads (")
    assert line.endswith("resuming the run (trainrun train) rewrites it, or restore the file "
                         "from a copy")


def test_reading_a_checkpoint_imports_no_grain():
    """The reader (what ``sample`` and ``eval`` read a run with) leaves the data pipeline
    unimported: about a tenth of a second of every such command's start."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys\n"
                           "import trainrun.checkpointing.reader\n"
                           "print('grain' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]


@pytest.mark.slow
def test_a_run_whose_metric_sinks_are_not_installed_here_is_still_read(tmp_path, monkeypatch):
    """A run trained where tensorboardX was installed (``metrics.tensorboard: true``, the
    default there) is loaded and sampled where it is not: reading a run needs none of the sinks
    it wrote to. Training from its config there is refused in one line naming the extra."""
    import sys

    import trainrun
    from trainrun.config import ConfigError

    run_dir = tmp_path / "run"
    run(load_config("lm", ["steps=2", "checkpoint.every=2", "metrics.tensorboard=true",
                           "model.d_model=32", "model.layers=1", "model.heads=2",
                           "eval.every=0"]), run_dir, out=io.StringIO())
    assert (run_dir / "tensorboard").is_dir()
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not installed, as extras sees it
    config = saved_config(run_dir)
    assert config.metrics.tensorboard
    model = trainrun.load(run_dir)
    assert model.step == 2 and len(model.generate([1, 2], 3)) == 5
    with pytest.raises(ConfigError, match=r"pip install 'trainrun\[tensorboard\]'"):
        load_config(str(run_dir / "config.yaml"))
