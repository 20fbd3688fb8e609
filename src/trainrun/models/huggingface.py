"""Weights in and out of Hugging Face's GPT-2 layout: a model directory of ``config.json`` and
``model.safetensors``, as ``transformers``' ``save_pretrained`` writes it and
``from_pretrained`` reads it, through ``safetensors``' NumPy API (neither ``transformers`` nor
PyTorch is imported). The tensor-by-tensor mapping and the transformer config GPT-2 needs:
docs/internals.md, "GPT-2 weights".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import TransformerModel
from trainrun.errors import UserError

PyTree = Any
WEIGHTS, CONFIG = "model.safetensors", "config.json"
PREFIX = "transformer."


class WeightsError(UserError):
    """Weights that do not fit the model; the CLI prints it on one line and exits 2."""


def config_from_hf(hf: dict[str, Any]) -> TransformerModel:
    """The transformer config a GPT-2 ``config.json`` describes."""
    if hf.get("model_type") != "gpt2":
        raise WeightsError(f"config.json has model_type {hf.get('model_type')!r}; trainrun reads "
                           "the GPT-2 family (model_type 'gpt2')")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise WeightsError(f"activation_function {hf['activation_function']!r} is not GPT-2's "
                           "tanh GELU (gelu_new), the one trainrun's transformer has")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise WeightsError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not "
                           "supported; export the model without them")
    d, inner = hf["n_embd"], hf.get("n_inner") or 4 * hf["n_embd"]
    if inner % d:
        raise WeightsError(f"n_inner {inner} is not a multiple of n_embd {d}")
    if abs(hf.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        raise WeightsError(f"layer_norm_epsilon {hf['layer_norm_epsilon']} differs from the "
                           "1e-5 trainrun's layer norms use")
    return TransformerModel(vocab=hf["vocab_size"], d_model=d, layers=hf["n_layer"],
                            heads=hf["n_head"], mlp_ratio=inner // d, seq_len=hf["n_positions"],
                            positions="learned", bias=True,
                            init_std=hf.get("initializer_range", 0.02))


def config_to_hf(cfg: TransformerModel) -> dict[str, Any]:
    """A GPT-2 ``config.json`` for ``cfg`` (which must have GPT-2's layout)."""
    if cfg.positions != "learned" or not cfg.bias:
        raise WeightsError("only a transformer with GPT-2's layout exports to it: set "
                           "model.positions=learned and model.bias=true")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "activation_function": "gelu_new", "vocab_size": cfg.vocab, "n_embd": cfg.d_model,
            "n_layer": cfg.layers, "n_head": cfg.heads, "n_inner": cfg.mlp_ratio * cfg.d_model,
            "n_positions": cfg.seq_len, "layer_norm_epsilon": 1e-5,
            "initializer_range": cfg.init_std, "tie_word_embeddings": True,
            "scale_attn_weights": True, "attn_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "resid_pdrop": cfg.dropout, "bos_token_id": None, "eos_token_id": None}


def _name_map(cfg: TransformerModel) -> dict[str, tuple[str, ...]]:
    """GPT-2 tensor name -> trainrun param path; c_attn is handled apart (one tensor, three
    params)."""
    names: dict[str, tuple[str, ...]] = {
        "wte.weight": ("embed", "embedding"), "wpe.weight": ("positions",),
        "ln_f.weight": ("ln_f", "scale"), "ln_f.bias": ("ln_f", "bias")}
    for i in range(cfg.layers):
        block = ("blocks", str(i))
        for hf, norm in (("ln_1", "ln1"), ("ln_2", "ln2")):
            names[f"h.{i}.{hf}.weight"] = (*block, norm, "scale")
            names[f"h.{i}.{hf}.bias"] = (*block, norm, "bias")
        for hf, ours in (("attn.c_proj", ("attn", "o")), ("mlp.c_fc", ("mlp", "up")),
                         ("mlp.c_proj", ("mlp", "down"))):
            names[f"h.{i}.{hf}.weight"] = (*block, *ours, "kernel")
            names[f"h.{i}.{hf}.bias"] = (*block, *ours, "bias")
    return names


def params_from_hf(tensors: dict[str, np.ndarray], cfg: TransformerModel,
                   template: PyTree) -> PyTree:
    """trainrun params (a pure dict shaped like ``template``) from GPT-2's tensors. A missing or
    unexpected name, or a shape that differs, raises ``WeightsError`` naming the tensor."""
    tensors = {k.removeprefix(PREFIX): v for k, v in tensors.items()
               if k.removeprefix(PREFIX) != "lm_head.weight"}  # tied to wte when present
    wanted = _name_map(cfg)
    attn = {f"h.{i}.attn.c_attn.{kind}" for i in range(cfg.layers) for kind in ("weight", "bias")}
    unexpected = sorted(set(tensors) - set(wanted) - attn)
    if unexpected:
        raise WeightsError(f"tensor {unexpected[0]!r} has no place in the model "
                           f"({len(unexpected)} such); is it a GPT-2 checkpoint of this config?")
    params = _copy(template)
    for name, path in wanted.items():
        _set(params, path, _take(tensors, name, _get(template, path).shape))
    d = cfg.d_model
    for i in range(cfg.layers):
        weight = _take(tensors, f"h.{i}.attn.c_attn.weight", (d, 3 * d))
        bias = _take(tensors, f"h.{i}.attn.c_attn.bias", (3 * d,))
        for j, proj in enumerate("qkv"):
            _set(params, ("blocks", str(i), "attn", proj, "kernel"), weight[:, j * d:(j + 1) * d])
            _set(params, ("blocks", str(i), "attn", proj, "bias"), bias[j * d:(j + 1) * d])
    return params


def params_to_hf(params: PyTree, cfg: TransformerModel) -> dict[str, np.ndarray]:
    """GPT-2's tensors (float32, ``transformer.`` prefixed) from trainrun params."""
    out = {PREFIX + name: np.asarray(_get(params, path), np.float32)
           for name, path in _name_map(cfg).items()}
    for i in range(cfg.layers):
        attn = params["blocks"][str(i)]["attn"]
        out[f"{PREFIX}h.{i}.attn.c_attn.weight"] = np.concatenate(
            [np.asarray(attn[p]["kernel"], np.float32) for p in "qkv"], axis=1)
        out[f"{PREFIX}h.{i}.attn.c_attn.bias"] = np.concatenate(
            [np.asarray(attn[p]["bias"], np.float32) for p in "qkv"])
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def read_model_dir(path: Path) -> tuple[TransformerModel, dict[str, np.ndarray]]:
    """(config, tensors) of a Hugging Face GPT-2 model directory."""
    from safetensors.numpy import load_file

    config_file, weights_file = path / CONFIG, path / WEIGHTS
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise WeightsError(f"{path} is not a Hugging Face model directory: {needed.name} is "
                               "missing (save_pretrained writes config.json and "
                               "model.safetensors)")
    try:
        hf = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    except (ValueError, OSError) as err:
        raise WeightsError(f"cannot read {path}: {err}".replace("\n", " ")) from None
    return config_from_hf(hf), tensors


def write_model_dir(params: PyTree, cfg: TransformerModel, path: Path) -> Path:
    """``config.json`` and ``model.safetensors`` that ``transformers`` loads as GPT2LMHeadModel."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(params_to_hf(params, cfg), str(path / WEIGHTS), metadata={"format": "pt"})
    (path / CONFIG).write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    return path


def _take(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise WeightsError(f"tensor {PREFIX}{name} is missing from the checkpoint")
    value = tensors[name]
    if tuple(value.shape) != tuple(shape):
        raise WeightsError(f"tensor {PREFIX}{name} has shape {tuple(value.shape)}; the model's "
                           f"param has {tuple(shape)} (does config.json match the weights?)")
    return value


def _get(tree: PyTree, path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _set(tree: PyTree, path: tuple[str, ...], value: np.ndarray) -> None:
    for part in path[:-1]:
        tree = tree[part]
    tree[path[-1]] = np.asarray(value, np.float32)


def _copy(tree: PyTree) -> PyTree:
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
