"""LoRA adapters in and out of PEFT's adapter directory: ``adapter_config.json`` and
``adapter_model.safetensors``, as ``peft``'s ``PeftModel.save_pretrained`` writes them and
``PeftModel.from_pretrained`` reads them, through ``safetensors``' NumPy API (neither ``peft``,
``transformers`` nor PyTorch is imported).

trainrun's adapter on a linear layer is ``a`` ``[d_in, rank]`` and ``b`` ``[rank, d_out]``,
adding ``(alpha / rank) x a b``; PEFT's is ``lora_A.weight`` ``[rank, d_in]`` and
``lora_B.weight`` ``[d_out, rank]``, adding ``scaling x A^T B^T``, so ``A = a^T``, ``B = b^T``
and the scalings are equal. Two model families: the Llama family (``llama``, ``qwen2``,
``mistral``), one HF module per trainrun layer; GPT-2, whose ``attn.c_attn`` holds q, k and v in
one Conv1D, so trainrun's q/k/v adapters travel as one ``c_attn`` adapter of the summed rank
(``rank_pattern`` / ``alpha_pattern`` keep its scale).

An adapter directory may be on object storage (``gs://``, ``s3://``), its files read through
the storage layer, as may the base model its ``base_model_name_or_path`` names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import LoraConfig, TransformerModel
from trainrun.config.sections import LoraTarget
from trainrun.models.hf_config import checked_adapter_config
from trainrun.models.huggingface import (
    LLAMA_FAMILY,
    MODEL_TYPES,
    WeightsError,
    read_file,
    refuse_unreadable,
)
from trainrun.rundir import location

Location = location.Location  # a local path, or a gs:// or s3:// one

PyTree = Any
ADAPTER_WEIGHTS, ADAPTER_CONFIG, ADAPTER_BIN = (
    "adapter_model.safetensors", "adapter_config.json", "adapter_model.bin")
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# trainrun's order, kept in configs
TARGETS: tuple[LoraTarget, ...] = ("q", "k", "v", "o", "gate", "up", "down")

# trainrun target -> (block part, HF module path inside a decoder layer)
_LLAMA = {"q": ("attn", "self_attn.q_proj"), "k": ("attn", "self_attn.k_proj"),
          "v": ("attn", "self_attn.v_proj"), "o": ("attn", "self_attn.o_proj"),
          "gate": ("mlp", "mlp.gate_proj"), "up": ("mlp", "mlp.up_proj"),
          "down": ("mlp", "mlp.down_proj")}
# GPT-2's c_proj names two layers, so its target_modules entries keep the parent's name.
_GPT2 = {"o": ("attn", "attn.c_proj"), "up": ("mlp", "mlp.c_fc"),
         "down": ("mlp", "mlp.c_proj")}
C_ATTN = "attn.c_attn"
_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<kind>A|B)\.weight")
# init_lora_weights values whose adapters fit a base model PEFT changed while initialising them.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The one rank, alpha and target set an adapter directory describes, in trainrun's terms."""

    rank: int
    alpha: float
    targets: tuple[LoraTarget, ...]  # among TARGETS, in their order

    def config(self) -> LoraConfig:
        """``model.lora`` for these adapters."""
        return LoraConfig(rank=self.rank, alpha=self.alpha, targets=self.targets)


def is_adapter_dir(path: Location) -> bool:
    """Whether ``path`` is a PEFT adapter directory (it has ``adapter_config.json``)."""
    return location.is_file(_folder(path) / ADAPTER_CONFIG)


def _folder(path: Location) -> Location:
    """``path`` as its store's path type: a remote one is kept, a local one made a Path."""
    return path if location.is_remote(path) else Path(path)


def base_model_name(path: Location) -> str | None:
    """``base_model_name_or_path`` of an adapter directory: the model its adapters were trained
    on, as PEFT recorded it (a hub id, a path or a ``gs://``/``s3://`` location), or None."""
    name = _read_config(_folder(path)).get("base_model_name_or_path")
    return name if isinstance(name, str) and name else None


def adapter_files(params: PyTree, cfg: TransformerModel, model_type: str,
                  base_model: str | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """PEFT's tensors (float32, contiguous) and ``adapter_config.json`` for the adapters in
    ``params`` of a model with config ``cfg``, whose base is a ``model_type`` checkpoint named
    ``base_model`` (a hub id or path; PeftModel loads it when given only the adapter)."""
    _check_model_type(model_type)
    if cfg.lora is None or not cfg.adapted:
        raise WeightsError("the model has no LoRA adapters to export; set model.lora")
    rank, alpha = cfg.lora.rank, float(cfg.lora.alpha)
    targets: list[str] = [t for t in TARGETS if t in cfg.adapted]
    tensors: dict[str, np.ndarray] = {}
    modules: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    if model_type in LLAMA_FAMILY:
        fused = [t for t in targets if t in ("q", "k", "v", "gate", "up")]
        if model_type == "phi3" and fused:
            raise WeightsError(f"LoRA on {', '.join(fused)} of a phi3 model does not export: "
                               "Phi-3 fuses them into qkv_proj and gate_up_proj; train "
                               "adapters on o and down (model.lora.targets=[o, down])")
        for i in range(cfg.layers):
            for t in targets:
                a, b = _adapter(params, i, t, rank)
                _put(tensors, f"model.layers.{i}.{_LLAMA[t][1]}", a.T, b.T)
        modules = [_LLAMA[t][1].rsplit(".", 1)[1] for t in targets]
    else:
        fused = [t for t in "qkv" if t in targets]
        d = cfg.d_model
        for i in range(cfg.layers):
            block = f"transformer.h.{i}"
            if fused:
                # One adapter of rank n * rank: A stacks the a's; B holds each b in its
                # projection's rows and its own columns, zeros elsewhere.
                pairs = [_adapter(params, i, t, rank) for t in fused]
                big_b = np.zeros((3 * d, rank * len(fused)), np.float32)
                for n, (t, (_, b)) in enumerate(zip(fused, pairs, strict=True)):
                    j = "qkv".index(t)
                    if b.shape[1] != d:
                        raise WeightsError(f"blocks.{i}.attn.{t}_lora.b has shape {b.shape}; "
                                           f"GPT-2's c_attn needs [rank, {d}]")
                    big_b[j * d:(j + 1) * d, n * rank:(n + 1) * rank] = b.T
                _put(tensors, f"{block}.{C_ATTN}", np.concatenate([a.T for a, _ in pairs]),
                     big_b)
            for t in targets:
                if t in _GPT2:
                    a, b = _adapter(params, i, t, rank)
                    _put(tensors, f"{block}.{_GPT2[t][1]}", a.T, b.T)
        if fused:
            modules.append("c_attn")
            if len(fused) > 1:  # the same scale, alpha / rank, at the summed rank
                rank_pattern["c_attn"] = rank * len(fused)
                alpha_pattern["c_attn"] = _number(alpha * len(fused))
        modules += [_GPT2[t][1] for t in targets if t in _GPT2]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": _number(alpha), "target_modules": modules,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": model_type == "gpt2", "use_rslora": False,
        "use_dora": False, "lora_bias": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None,
        "init_lora_weights": True, "inference_mode": True, "revision": None}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, config


def write_adapter_dir(params: PyTree, cfg: TransformerModel, model_type: str,
                      base_model: str | None, path: Path) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` that
    ``PeftModel.from_pretrained(base, path)`` loads onto a ``model_type`` model."""
    from safetensors.numpy import save_file

    tensors, config = adapter_files(params, cfg, model_type, base_model)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def read_adapter_dir(path: Location, cfg: TransformerModel,
                     model_type: str) -> tuple[LoraSettings, dict[str, np.ndarray]]:
    """(settings, trainrun adapter params by dotted name, e.g. ``blocks.0.attn.q_lora.a``) of a
    PEFT LoRA adapter directory for a ``model_type`` base model whose trainrun config is ``cfg``
    (its ``lora`` is not consulted). What trainrun's adapters cannot express exactly raises
    ``WeightsError`` on one line, naming the field and what to do."""
    _check_model_type(model_type)
    path = _folder(path)
    config = _read_config(path)
    _check_config(config, cfg)
    kinds = _module_kinds(model_type)
    named = _named_modules(config, kinds)
    tensors = _read_tensors(path)
    prefix = "model.layers" if model_type in LLAMA_FAMILY else "transformer.h"
    excluded = {(i, kind) for i in range(cfg.layers) for kind in kinds
                if _excluded(config.get("exclude_modules"), f"{prefix}.{i}.{kind}")}
    modules = _modules(tensors, cfg, model_type, kinds, excluded)
    rslora = bool(config.get("use_rslora"))
    for name, matched in named.items():
        everywhere_excluded = all((i, k) in excluded for k in matched for i in range(cfg.layers))
        if not matched & modules and not everywhere_excluded:
            raise WeightsError(f"target module {name!r} has no lora_A/lora_B tensors in "
                               f"{ADAPTER_WEIGHTS}; the file does not match its config")
    # Per HF module kind, over all layers: (A, B, PEFT's scaling) of each layer.
    found: dict[str, list[tuple[np.ndarray, np.ndarray, float]]] = {}
    for kind in kinds:
        if kind not in modules:
            continue
        found[kind] = []
        d_in, d_out = _dims(cfg, model_type, kind)
        kept = next((i for i in range(cfg.layers) if (i, kind) not in excluded), None)
        if kept is None:
            raise WeightsError(f"{ADAPTER_WEIGHTS} adapts {kind}, which exclude_modules "
                               "excludes in every layer; the file does not match its config")
        rank = tensors[f"{prefix}.{kept}.{kind}.lora_A.weight"].shape[0]
        for i in range(cfg.layers):
            module = f"{prefix}.{i}.{kind}"
            alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
            if (i, kind) in excluded:  # PEFT left it unadapted: a zero adapter is the same layer
                found[kind].append((np.zeros((rank, d_in), np.float32),
                                    np.zeros((d_out, rank), np.float32),
                                    alpha / (math.sqrt(rank) if rslora else rank)))
                continue
            a_t, b_t = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
            r = a_t.shape[0]
            if a_t.shape != (r, d_in) or b_t.shape != (d_out, r):
                raise WeightsError(f"{module} has lora_A {a_t.shape} and lora_B {b_t.shape}; the "
                                   f"model's layer needs [r, {d_in}] and [{d_out}, r] (is the "
                                   "adapter for this base model?)")
            want_r = _pattern(config.get("rank_pattern"), module, config.get("r", 8))
            if r != want_r:
                raise WeightsError(f"{module} has rank {r} but adapter_config.json says "
                                   f"{want_r}; the file does not match its config")
            found[kind].append((a_t, b_t, alpha / (math.sqrt(r) if rslora else r)))
    adapters = _trainrun_adapters(found, cfg, model_type, int(config.get("r", 8)))
    return _settings(adapters)


def _settings(adapters: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]
              ) -> tuple[LoraSettings, dict[str, np.ndarray]]:
    """One rank and alpha for all of ``adapters`` ((layer, target) -> (a, b, scale)); a module
    whose scale differs from the first's has its b scaled to match, which is exact."""
    ranks = {(t, a.shape[1]) for (_, t), (a, _, _) in adapters.items()}  # over every layer
    if len({r for _, r in ranks}) > 1:
        listed = ", ".join(f"{t} {r}" for t, r in sorted(ranks, key=_target_order))
        raise WeightsError(f"the adapter's ranks differ ({listed}; rank_pattern?); trainrun has "
                           "one rank for every adapter: train the adapter with one r")
    rank = next(iter(ranks))[1]
    first = min(adapters, key=lambda key: (key[0], TARGETS.index(key[1])))
    scale = adapters[first][2]
    out: dict[str, np.ndarray] = {}
    for (i, t), (a, b, s) in adapters.items():
        part = "attn" if t in ("q", "k", "v", "o") else "mlp"
        out[f"blocks.{i}.{part}.{t}_lora.a"] = np.ascontiguousarray(a, np.float32)
        out[f"blocks.{i}.{part}.{t}_lora.b"] = np.ascontiguousarray(
            b if s == scale else b * np.float32(s / scale), np.float32)
    targets: tuple[LoraTarget, ...] = tuple(t for t in TARGETS if any(t == u for u, _ in ranks))
    return LoraSettings(rank=rank, alpha=scale * rank, targets=targets), out


def _trainrun_adapters(found: dict[str, list[tuple[np.ndarray, np.ndarray, float]]],
                       cfg: TransformerModel, model_type: str, rank: int
                       ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
    """(layer, trainrun target) -> (a, b, scale) from PEFT's per-module (A, B, scale)."""
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] = {}
    table = _LLAMA if model_type in LLAMA_FAMILY else _GPT2
    for t, (_, kind) in table.items():
        for i, (a_t, b_t, s) in enumerate(found.get(kind, ())):
            out[i, t] = (a_t.T, b_t.T, s)
    if C_ATTN in found:
        d = cfg.d_model
        layers = found[C_ATTN]
        columns = _c_attn_columns([b_t for _, b_t, _ in layers], d, rank)
        for i, (a_t, b_t, s) in enumerate(layers):
            for j, t in enumerate("qkv"):
                if columns[t] is not None:
                    cols = columns[t]
                    out[i, t] = (a_t[cols].T, b_t[j * d:(j + 1) * d, cols].T, s)
    return out


def _c_attn_columns(bs: list[np.ndarray], d: int, rank: int) -> dict[str, Any]:
    """Which of c_attn's rank components each of q, k, v uses. An adapter that trainrun wrote
    (or any whose B gives each projection columns of its own) splits back into the projections
    that have columns, at their own rank; any other gives q, k and v all of them, or, when B is
    all zero, the config's rank ``rank`` of them."""
    r = bs[0].shape[1]
    used = {t: np.zeros(r, bool) for t in "qkv"}
    for b_t in bs:
        for j, t in enumerate("qkv"):
            used[t] |= np.any(b_t[j * d:(j + 1) * d] != 0, axis=0)
    shared = used["q"].astype(int) + used["k"] + used["v"]
    if shared.max() == 1:
        return {t: np.flatnonzero(u) if u.any() else None for t, u in used.items()}
    if shared.max() == 0:  # B all zero (untrained): any r of A's rows give the same zero delta
        return {t: np.arange(min(r, rank)) for t in "qkv"}
    return {t: np.arange(r) for t in "qkv"}  # dense: each projection takes every column


def _check_config(config: dict[str, Any], cfg: TransformerModel) -> None:
    """Refuses, on one line each, what changes the adapter's maths beyond ``scaling x A^T B^T``
    on the linear layers trainrun adapts."""
    if config.get("peft_type", "LORA") != "LORA":
        raise WeightsError(f"adapter_config.json has peft_type {config.get('peft_type')!r}; "
                           "trainrun reads LoRA adapters (peft_type LORA)")
    refusals = {
        "use_dora": "DoRA's magnitude vectors have no place in trainrun's LoRA; train without "
                    "use_dora, or merge the adapter into the base model",
        "lora_bias": "trainrun's adapters have no bias on lora_B; train with lora_bias=false",
        "modules_to_save": "trainrun cannot load full copies of modules_to_save beside the "
                           "adapters; merge the adapter into the base model instead",
        "trainable_token_indices": "trainrun does not train single token embeddings; merge "
                                   "the adapter into the base model instead",
        "layer_replication": "layer_replication changes the model's depth; merge the adapter "
                             "into the base model instead",
        "target_parameters": "adapters on parameters (target_parameters) are not trainrun's "
                             "linear-layer adapters; train with target_modules",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies only "
                                   "after its tokens; train a plain LoRA adapter",
        "use_qalora": "QA-LoRA pools the layer's input; train a plain LoRA adapter",
        "use_bdlora": "BD-LoRA's block-diagonal factors are not trainrun's; train a plain LoRA "
                      "adapter",
        "arrow_config": "Arrow routing mixes several adapters; load one plain LoRA adapter",
        "kasa_config": "KaSA changes the base weights and adds singular values; train a plain "
                       "LoRA adapter",
        "monteclora_config": "MonteCLoRA samples its adapters; train a plain LoRA adapter",
    }
    for field, fix in refusals.items():
        if config.get(field):
            raise WeightsError(f"adapter_config.json sets {field}: {fix}")
    if config.get("bias", "none") != "none":
        raise WeightsError(f"adapter_config.json has bias {config['bias']!r}; trainrun's "
                           "adapters leave the base biases alone: train with bias='none'")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise WeightsError(f"init_lora_weights {init!r} changed the base weights as well as "
                           "the adapter; save it with path_initial_model_for_weight_conversion "
                           "(PiSSA/OLoRA/CorDA) or merge it into its base model")
    layers = config.get("layers_to_transform")
    if layers is not None:
        chosen = {layers} if isinstance(layers, int) else set(layers)
        if len(chosen) != cfg.layers or chosen != set(range(cfg.layers)):
            raise WeightsError(f"layers_to_transform {layers} adapts only some layers; trainrun "
                               "adapts every layer: train the adapter on all of them")
    if config.get("use_rslora") and (config.get("rank_pattern") or config.get("alpha_pattern")):
        raise WeightsError("use_rslora with rank_pattern/alpha_pattern: PEFT refuses it too; "
                           "drop one of them")


def _named_modules(config: dict[str, Any], kinds: tuple[str, ...]) -> dict[str, set[str]]:
    """Each entry of a target_modules list -> the module kinds it names; an entry that names no
    layer trainrun adapts is refused. A regex or "all-linear" gives {}: the tensors tell."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return {}
    named: dict[str, set[str]] = {}
    for name in targets:
        # PEFT matches a list entry against the module's name or a dotted suffix of it.
        named[name] = {k for k in kinds if k == name or k.endswith("." + name)
                       or name.endswith("." + k)}
        if not named[name]:
            shorts = ", ".join(k.rsplit(".", 1)[1] for k in kinds)
            raise WeightsError(f"target module {name!r} is not a linear layer trainrun adapts "
                               f"({shorts}); train the adapter without it")
    return named


def _excluded(exclude: list[str] | str | None, module: str) -> bool:
    """Whether PEFT's ``exclude_modules`` keeps ``module`` (a full name) unadapted: a string
    matches the whole name as a regular expression, a list entry the name or a dotted suffix."""
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, module) is not None
    return module in exclude or any(module.endswith(f".{name}") for name in exclude)


def _modules(tensors: dict[str, np.ndarray], cfg: TransformerModel, model_type: str,
             kinds: tuple[str, ...], excluded: set[tuple[int, str]]) -> set[str]:
    """The module kinds (e.g. ``self_attn.q_proj``) that carry adapters; every tensor must be
    one of theirs, and every layer but those ``excluded`` must have both of each kind's."""
    prefix = "model.layers" if model_type in LLAMA_FAMILY else "transformer.h"
    layer = re.compile(rf"{re.escape(prefix)}\.(\d+)\.(.+)")
    present: set[tuple[int, str, str]] = set()
    for name in tensors:
        match = _TENSOR.fullmatch(name)
        where = layer.fullmatch(match["module"]) if match else None
        if match is None:
            raise WeightsError(f"tensor {PREFIX}{name} is not a LoRA A/B weight (DoRA magnitude, "
                               "embedding adapter or saved module?); trainrun reads plain LoRA "
                               "adapters on linear layers")
        if where is None or where[2] not in kinds:
            raise WeightsError(f"tensor {PREFIX}{name} adapts {match['module']}, not a linear "
                               f"layer trainrun adapts ({', '.join(kinds)}); train the adapter "
                               "without it")
        if int(where[1]) >= cfg.layers:
            raise WeightsError(f"tensor {PREFIX}{name} is for layer {where[1]}; the model has "
                               f"{cfg.layers} layers (is the adapter for this base model?)")
        present.add((int(where[1]), where[2], match["kind"]))
    modules = {kind for _, kind, _ in present}
    if not modules:
        raise WeightsError(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    for kind in modules:
        for i in range(cfg.layers):
            for ab in "AB":
                if (i, kind, ab) not in present and (i, kind) not in excluded:
                    raise WeightsError(f"tensor {PREFIX}{prefix}.{i}.{kind}.lora_{ab}.weight is "
                                       "missing; trainrun adapts a layer kind in every block")
    return modules


def _read_config(path: Location) -> dict[str, Any]:
    if not location.is_file(path / ADAPTER_CONFIG):
        raise WeightsError(f"{path} is not a PEFT adapter directory: {ADAPTER_CONFIG} is "
                           "missing (PeftModel.save_pretrained writes it)")
    data = read_file(path / ADAPTER_CONFIG)
    try:
        config = json.loads(data)
    except ValueError as err:  # not JSON, or not UTF-8 text
        raise WeightsError(f"cannot read {path / ADAPTER_CONFIG}: {err}"
                           .replace("\n", " ")) from None
    if not isinstance(config, dict):
        raise WeightsError(f"{path / ADAPTER_CONFIG} is not a JSON object")
    return checked_adapter_config(config, str(path / ADAPTER_CONFIG))


def _read_tensors(path: Location) -> dict[str, np.ndarray]:
    """The adapter's tensors, whole (they are small beside the model): read from disk, or as
    one object's bytes from object storage."""
    from safetensors import SafetensorError
    from safetensors.numpy import load, load_file

    weights = path / ADAPTER_WEIGHTS
    if not location.is_file(weights):
        if location.is_file(path / ADAPTER_BIN):
            raise WeightsError(f"{path} has {ADAPTER_BIN} (a pickle) but no {ADAPTER_WEIGHTS}; "
                               "save it with save_pretrained(..., safe_serialization=True)")
        raise WeightsError(f"{path} has no {ADAPTER_WEIGHTS}; PeftModel.save_pretrained "
                           "writes it")
    if not location.is_remote(weights):  # safetensors says "No such file" for a denied read
        refuse_unreadable(location.model_file(weights, WeightsError))
    data = read_file(weights) if location.is_remote(weights) else None
    try:
        tensors = load_file(str(weights)) if data is None else load(data)
    except (SafetensorError, ValueError, OSError) as err:
        raise WeightsError(f"cannot read {weights} ({err}); is it complete? save it "
                           "again".replace("\n", " ")) from None
    for name, value in sorted(tensors.items()):
        if value.dtype.kind != "f":  # an integer or boolean tensor would be trained as floats
            raise WeightsError(f"tensor {name} in {weights} has dtype {value.dtype}; LoRA "
                               "weights are floats: save the adapter's float weights")
    return {name.removeprefix(PREFIX): np.asarray(value, np.float32)
            for name, value in tensors.items()}


def _module_kinds(model_type: str) -> tuple[str, ...]:
    if model_type in LLAMA_FAMILY:
        return tuple(module for _, module in _LLAMA.values())
    return (C_ATTN, *(module for _, module in _GPT2.values()))


def _dims(cfg: TransformerModel, model_type: str, kind: str) -> tuple[int, int]:
    """(d_in, d_out) of a module kind in the model ``cfg`` describes."""
    d, hidden = cfg.d_model, cfg.hidden
    if model_type == "gpt2":
        return {C_ATTN: (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, hidden),
                "mlp.c_proj": (hidden, d)}[kind]
    q, kv = cfg.heads * cfg.attention_head_dim, cfg.kv_key_heads * cfg.attention_head_dim
    return {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, hidden),
            "mlp.up_proj": (d, hidden), "mlp.down_proj": (hidden, d)}[kind]


def _pattern(patterns: Any, module: str, default: Any) -> float:
    """PEFT's per-module override: the first key of ``patterns`` that matches the module's name
    or a dotted suffix of it (peft.utils.other.get_pattern_key)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(default)


def _adapter(params: PyTree, i: int, target: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    part = "attn" if target in ("q", "k", "v", "o") else "mlp"
    name = f"blocks.{i}.{part}.{target}_lora"
    try:
        blocks = params["blocks"]
        adapter = (blocks[str(i)] if str(i) in blocks else blocks[i])[part][f"{target}_lora"]
        a, b = np.asarray(adapter["a"], np.float32), np.asarray(adapter["b"], np.float32)
    except (KeyError, TypeError, IndexError):
        raise WeightsError(f"params have no {name}.a/.b; are they the adapted model's?") from None
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != rank or b.shape[0] != rank:
        raise WeightsError(f"{name} has a {a.shape} and b {b.shape}; model.lora.rank is {rank}")
    return a, b


def _put(tensors: dict[str, np.ndarray], module: str, lora_a: np.ndarray,
         lora_b: np.ndarray) -> None:
    tensors[f"{PREFIX}{module}.lora_A.weight"] = lora_a
    tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_b


def _check_model_type(model_type: str) -> None:
    if model_type not in MODEL_TYPES:
        raise WeightsError(f"model_type {model_type!r} has no PEFT adapter layout in trainrun; "
                           f"it knows {', '.join(MODEL_TYPES)}")


def _number(value: float) -> int | float:
    """An integral alpha as an int, as PEFT's configs write it."""
    return int(value) if float(value).is_integer() else float(value)


def _target_order(item: tuple[str, int]) -> tuple[int, int]:
    return TARGETS.index(item[0]), item[1]
