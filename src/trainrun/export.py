"""``trainrun export``: a run's newest readable checkpoint written as a Hugging Face model
directory."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from trainrun.checkpointing.reader import latest_params, saved_config
from trainrun.models.huggingface import WeightsError, write_model_dir
from trainrun.models.transformer import merge_adapters


def export_run(run_dir: Path, to: Path, *, merge: bool = False) -> tuple[int, Path]:
    """A run's newest readable checkpoint as a GPT-2 model directory: ``(step, to)``. A model
    with LoRA adapters needs ``merge`` (GPT-2's layout has no place for them)."""
    config = saved_config(run_dir)
    cfg = config.model
    if cfg.kind != "transformer":
        raise WeightsError(f"run {run_dir} trains model.kind={cfg.kind}; export writes the "
                           "transformer in GPT-2's layout")
    if cfg.lora is not None and not merge:
        raise WeightsError("the model has LoRA adapters, which GPT-2's layout cannot hold; "
                           "pass --merge to fold them into the weights")
    step, params = latest_params(run_dir, config)
    cfg, params = merge_adapters(cfg, jax.tree.map(np.asarray, params))
    return step, write_model_dir(params, cfg, to)
