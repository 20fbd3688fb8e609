"""What a fresh run starts from when ``init.from`` names a source instead of random init:

    a trainrun run directory      its newest readable checkpoint: the params (``init.load:
                                  params``) or the whole state (``state``: optimizer moments,
                                  step, key and loss scale too: a fork of that run)
    a Hugging Face directory      ``config.json`` + ``model.safetensors`` of the GPT-2 family
    a ``.safetensors`` file       GPT-2's tensor names, or trainrun's dotted param paths
                                  (``blocks.0.attn.q.kernel``)

Every param of the source must be a param of the model with the same shape; a model param the
source lacks is an error, except LoRA adapters, which keep their fresh init (a fine-tune adds
them to a pretrained base). Loading happens before the run directory is written, so a source
that does not fit is one line and exit 2 with nothing created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainrun import extras, rundir
from trainrun.config import RunConfig, TransformerModel
from trainrun.models.huggingface import (
    PREFIX,
    WEIGHTS,
    WeightsError,
    params_from_hf,
    read_model_dir,
)
from trainrun.program.optim import param_name

PyTree = Any
ADAPTER = "_lora."  # params a source may lack: they keep their fresh init


def source_kind(path: Path) -> str:
    """"run", "huggingface" or "safetensors"; a path that is none of them is an error."""
    if path.is_dir() and (path / rundir.CONFIG).is_file():
        return "run"
    if path.is_dir() and (path / WEIGHTS).is_file():
        extras.require("huggingface", f"init.from {path}")
        return "huggingface"
    if path.is_file() and path.suffix == ".safetensors":
        extras.require("huggingface", f"init.from {path}")
        return "safetensors"
    raise WeightsError(f"init.from {path}: not a trainrun run directory, a Hugging Face model "
                       "directory (config.json + model.safetensors) or a .safetensors file")


def load_params(source: str, config: RunConfig, fresh: PyTree) -> PyTree:
    """The params to start ``config``'s run from: the source's, laid into ``fresh`` (the
    model's freshly initialised params, NumPy), which supplies the adapters a source lacks."""
    path = Path(source).expanduser()
    kind = source_kind(path)
    if kind == "run":
        from trainrun.checkpointing.reader import latest_params, saved_config

        _, params = latest_params(path, saved_config(path))
        found = {param_name(p): np.asarray(x)
                 for p, x in jax.tree_util.tree_leaves_with_path(params)}
        return _laid_into(fresh, found, str(path))
    if config.model.kind != "transformer":
        raise WeightsError(f"init.from {path}: GPT-2 weights need model.kind=transformer "
                           f"(this run's is {config.model.kind})")
    if kind == "huggingface":
        _, tensors = read_model_dir(path)
        return _from_gpt2(tensors, config.model, fresh)
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, ValueError) as err:
        raise WeightsError(f"cannot read {path}: {err}".replace("\n", " ")) from None
    if any(name.startswith(PREFIX) or name == "wte.weight" for name in tensors):
        return _from_gpt2(tensors, config.model, fresh)
    return _laid_into(fresh, tensors, str(path))


def _from_gpt2(tensors: dict[str, np.ndarray], model: TransformerModel,
               fresh: PyTree) -> PyTree:
    base = _without_adapters(fresh)
    loaded = params_from_hf(tensors, model, base)
    found = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(loaded)}
    return _laid_into(fresh, found, "the GPT-2 checkpoint")


def _without_adapters(tree: PyTree) -> PyTree:
    if not isinstance(tree, dict):
        return tree
    return {k: _without_adapters(v) for k, v in tree.items() if not k.endswith("_lora")}


def _laid_into(fresh: PyTree, found: dict[str, np.ndarray], source: str) -> PyTree:
    """``fresh`` with each param replaced by the source's of the same dotted name."""
    wanted = {param_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(fresh)}
    unknown = sorted(set(found) - set(wanted))
    if unknown:
        raise WeightsError(f"{source} has param {unknown[0]!r}, which this model does not have "
                           f"({len(unknown)} such); check model settings against the source")
    missing = sorted(n for n in set(wanted) - set(found) if ADAPTER not in n)
    if missing:
        raise WeightsError(f"{source} lacks param {missing[0]!r} of this model "
                           f"({len(missing)} such); check model settings against the source")
    for name, value in found.items():
        if tuple(value.shape) != tuple(wanted[name].shape):
            raise WeightsError(f"param {name!r} has shape {tuple(value.shape)} in {source}; "
                               f"the model's is {tuple(wanted[name].shape)}")

    def pick(path: tuple[Any, ...], value: Any) -> Any:
        name = param_name(path)
        return np.asarray(found[name], np.asarray(value).dtype) if name in found else value

    return jax.tree_util.tree_map_with_path(pick, fresh)


def initial_state(config: RunConfig, fresh: Any, optimizer: Any, policy: Any,
                  shardings: Any) -> Any:
    """The state a fresh run starts from under ``config.init`` (``fresh``: the state random
    init gives, used for its adapters and, with ``load: state``, as the shape to match)."""
    from trainrun.program.state import state_from_params

    source = config.init.from_
    if source is None:
        raise ValueError("initial_state starts a run from init.from, which is not set")
    if config.init.load == "params":
        params = load_params(source, config, jax.device_get(fresh.params))
        return state_from_params(params, optimizer, config.seed, policy, shardings,
                                 fresh.model_state)
    path = Path(source).expanduser()
    if source_kind(path) != "run":
        raise WeightsError(f"init.load=state needs a trainrun run directory; {path} holds "
                           "weights only (use init.load=params)")
    from trainrun.checkpointing.reader import latest_state, saved_config

    _, state = latest_state(path, saved_config(path))
    have = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), state)
    want = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), fresh)
    # jaxlib ships no type for PyTreeDef, so mypy cannot see its comparison
    fits = jax.tree.structure(have) == jax.tree.structure(want)  # type: ignore[operator]
    if not fits or have != want:
        raise WeightsError(f"the state of {path} does not fit this run (another model, "
                           "optimizer or precision); use init.load=params for the params only")
    return jax.device_put(state, shardings)
