"""LoRA adapters in and out of PEFT's adapter directory: ``adapter_config.json`` and
``adapter_model.safetensors``, as ``peft``'s ``PeftModel.save_pretrained`` writes them and
``PeftModel.from_pretrained`` reads them, through ``safetensors``' NumPy API (neither ``peft``,
``transformers`` nor PyTorch is imported).

trainrun's adapter on a linear layer is ``a`` ``[d_in, rank]`` and ``b`` ``[rank, d_out]``,
adding ``(alpha / rank) x a b``; PEFT's is ``lora_A.weight`` ``[rank, d_in]`` and
``lora_B.weight`` ``[d_out, rank]``, adding ``scaling x A^T B^T``, so ``A = a^T``, ``B = b^T``
and the scalings are equal. Which module carries which adapter is the family's
(``Family.adapters``, its module under ``families/``): in the Llama layout one HF module per
trainrun layer; in GPT-2, whose ``attn.c_attn`` holds q, k and v in one Conv1D, trainrun's
q/k/v adapters travel as one ``c_attn`` adapter of the summed rank (``rank_pattern`` /
``alpha_pattern`` keep its scale); in Phi-3, ``qkv_proj`` and ``gate_up_proj`` each take one
adapter over the fused output, as trainrun's ``qkv_lora`` and ``gate_up_lora`` are.

A mixture of experts (a family whose adapters take ``experts``) keeps its experts in
``transformers`` as two 3-D parameters per layer, ``mlp.experts.gate_up_proj`` ``[experts, 2 x
width, d]`` and ``mlp.experts.down_proj`` ``[experts, d, width]``, and its router as
``mlp.gate.weight``; PEFT adapts them through ``target_parameters`` (its ``ParamWrapper``): per
expert ``e``, ``lora_A.weight`` rows ``e*r .. (e+1)*r`` and ``lora_B.weight`` columns
``j*experts + e``. trainrun's adapters on the experts' gate and up travel as one
``gate_up_proj`` adapter of the summed rank, block-diagonal (as PEFT itself converts an
adapter on the separate projections); two parameters of one module nest, the first
(``gate_up_proj``) then named ``mlp.experts.base_layer``.

An adapter directory may be on object storage (``gs://``, ``s3://``), its files read through
the storage layer, as may the base model its ``base_model_name_or_path`` names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import LoraConfig, TransformerModel
from trainrun.config.sections import LoraTarget
from trainrun.models.families import FAMILIES, MODEL_TYPES
from trainrun.models.families.family import AdapterLayout, Family
from trainrun.models.hf_config import checked_adapter_config
from trainrun.models.huggingface import WeightsError, read_file, refuse_unreadable
from trainrun.storage import location

Location = location.Location  # a local path, or a gs:// or s3:// one

PyTree = Any
ADAPTER_WEIGHTS, ADAPTER_CONFIG, ADAPTER_BIN = (
    "adapter_model.safetensors", "adapter_config.json", "adapter_model.bin")
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# trainrun's order, kept in configs
TARGETS: tuple[LoraTarget, ...] = ("q", "k", "v", "o", "gate", "up", "down", "router")

# trainrun's fused adapters -> the targets each spans
FUSED_TARGETS: dict[str, tuple[LoraTarget, ...]] = {"qkv": ("q", "k", "v"),
                                                    "gate_up": ("gate", "up")}
# A mixture's parameters PEFT adapts (target_parameters), each named as a module kind here.
GATE_UP, DOWN, ROUTER = "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"
EXPERT_KINDS = (GATE_UP, DOWN, ROUTER)
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


def base_model_name(path: Location | str | os.PathLike[str]) -> str | None:
    """``base_model_name_or_path`` of an adapter directory: the model its adapters were trained
    on, as PEFT recorded it (a hub id, a path or a ``gs://``/``s3://`` location), or None."""
    path = location.location(path)  # a path given here enters here
    name = _read_config(path).get("base_model_name_or_path")
    return name if isinstance(name, str) and name else None


@dataclasses.dataclass
class _Written:
    """What an adapter directory holds besides its settings: PEFT's tensors by name, and the
    target_modules, target_parameters, rank_pattern and alpha_pattern of its config."""

    tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    modules: list[str] = dataclasses.field(default_factory=list)
    parameters: list[str] = dataclasses.field(default_factory=list)
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)


def adapter_files(params: PyTree, cfg: TransformerModel, model_type: str,
                  base_model: str | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """PEFT's tensors (float32, contiguous) and ``adapter_config.json`` for the adapters in
    ``params`` of a model with config ``cfg``, whose base is a ``model_type`` checkpoint named
    ``base_model`` (a hub id or path; PeftModel loads it when given only the adapter)."""
    family = _family(model_type)
    if cfg.lora is None or not cfg.adapted:
        raise WeightsError("the model has no LoRA adapters to export; set model.lora")
    rank, alpha = cfg.lora.rank, float(cfg.lora.alpha)
    targets: list[str] = [t for t in TARGETS if t in cfg.adapted]
    layout = family.adapters
    written = (_joined_adapters(params, cfg, family, targets) if layout.joined is not None
               else _module_adapters(params, cfg, family, targets))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": _number(alpha), "target_modules": written.modules,
        "target_parameters": written.parameters or None,
        "rank_pattern": written.rank_pattern, "alpha_pattern": written.alpha_pattern,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": layout.fan_in_fan_out,
        "use_rslora": False, "use_dora": False, "lora_bias": False, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None,
        "init_lora_weights": True, "inference_mode": True, "revision": None}
    return {k: np.ascontiguousarray(v, np.float32) for k, v in written.tensors.items()}, config


def _module_adapters(params: PyTree, cfg: TransformerModel, family: Family,
                     targets: list[str]) -> _Written:
    """The adapters as one LoRA pair per module (a fused module's over its fused output) and,
    in a mixture, PEFT's ``target_parameters`` on the experts and router."""
    assert cfg.lora is not None
    _check_family(cfg, family, targets)
    layout, rank = family.adapters, cfg.lora.rank
    joint = {name: FUSED_TARGETS[name] for name in layout.fused
             if cfg.fused_projections and FUSED_TARGETS[name][0] in targets}
    in_fused = {t for spans in joint.values() for t in spans}
    moe = cfg.experts is not None
    mlp = ("gate", "up", "down", "router")
    plain = [t for t in targets if t not in in_fused and not (moe and t in mlp)]
    written = _Written()
    for i in range(cfg.layers):
        layer = f"{layout.layers}.{i}"
        for name in joint:
            a, b = _adapter(params, i, name, rank)
            _put(written.tensors, f"{layer}.{layout.fused[name]}", a.T, b.T)
        for t in plain:
            a, b = _adapter(params, i, t, rank)
            _put(written.tensors, f"{layer}.{layout.modules[t]}", a.T, b.T)
        if moe and cfg.expert_layer(i):
            _put_experts(written.tensors, params, cfg, i, [t for t in targets if t in mlp])
    for t in targets:
        module = next((layout.fused[name] for name, spans in joint.items() if t in spans),
                      layout.modules[t] if t in plain else None)
        if module is not None and module.rsplit(".", 1)[1] not in written.modules:
            written.modules.append(module.rsplit(".", 1)[1])
    if moe:
        _expert_parameters(written, targets, rank, float(cfg.lora.alpha))
    return written


def _expert_parameters(written: _Written, targets: list[str], rank: int, alpha: float) -> None:
    """A mixture's ``target_parameters``, and the summed rank of a joined gate and up."""
    joined = [t for t in ("gate", "up") if t in targets]
    written.parameters = ([GATE_UP] if joined else []) + (
        [DOWN] if "down" in targets else []) + ([ROUTER] if "router" in targets else [])
    if len(joined) > 1:  # the same scale, alpha / rank, at the summed rank
        key = rf".*\.{re.escape(GATE_UP.rsplit('.', 1)[1])}"
        written.rank_pattern[key] = rank * len(joined)
        written.alpha_pattern[key] = _number(alpha * len(joined))


def _joined_adapters(params: PyTree, cfg: TransformerModel, family: Family,
                     targets: list[str]) -> _Written:
    """The adapters where one module holds q, k and v (``AdapterLayout.joined``): trainrun's
    q/k/v adapters as one adapter of their summed rank, the others one pair per module."""
    assert cfg.lora is not None
    layout, rank = family.adapters, cfg.lora.rank
    assert layout.joined is not None
    fused = [t for t in "qkv" if t in targets]
    written = _Written()
    for i in range(cfg.layers):
        block = f"{layout.layers}.{i}"
        if fused:
            _put(written.tensors, f"{block}.{layout.joined}",
                 *_joined_pair(params, cfg, family, i, fused))
        for t in targets:
            if t in layout.modules:
                a, b = _adapter(params, i, t, rank)
                _put(written.tensors, f"{block}.{layout.modules[t]}", a.T, b.T)
    if fused:
        short = layout.joined.rsplit(".", 1)[1]
        written.modules.append(short)
        if len(fused) > 1:  # the same scale, alpha / rank, at the summed rank
            written.rank_pattern[short] = rank * len(fused)
            written.alpha_pattern[short] = _number(float(cfg.lora.alpha) * len(fused))
    written.modules += [layout.modules[t] for t in targets if t in layout.modules]
    return written


def _joined_pair(params: PyTree, cfg: TransformerModel, family: Family, i: int,
                 fused: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``i``'s q/k/v adapters (those of ``fused``) as one adapter of the summed rank: A
    stacks the a's; B holds each b in its projection's rows and its own columns, zeros
    elsewhere."""
    assert cfg.lora is not None and family.adapters.joined is not None
    rank, d = cfg.lora.rank, cfg.d_model
    pairs = [_adapter(params, i, t, rank) for t in fused]
    big_b = np.zeros((3 * d, rank * len(fused)), np.float32)
    for n, (t, (_, b)) in enumerate(zip(fused, pairs, strict=True)):
        j = "qkv".index(t)
        if b.shape[1] != d:
            raise WeightsError(f"blocks.{i}.attn.{t}_lora.b has shape {b.shape}; "
                               f"{family.title}'s {family.adapters.joined.rsplit('.', 1)[1]} "
                               f"needs [rank, {d}]")
        big_b[j * d:(j + 1) * d, n * rank:(n + 1) * rank] = b.T
    return np.concatenate([a.T for a, _ in pairs]), big_b


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


def read_adapter_dir(path: Location | str | os.PathLike[str], cfg: TransformerModel,
                     model_type: str) -> tuple[LoraSettings, dict[str, np.ndarray]]:
    """(settings, trainrun adapter params by dotted name, e.g. ``blocks.0.attn.q_lora.a``) of a
    PEFT LoRA adapter directory for a ``model_type`` base model whose trainrun config is ``cfg``
    (its ``lora`` is not consulted). What trainrun's adapters cannot express exactly raises
    ``WeightsError`` on one line, naming the field and what to do."""
    path = location.location(path)  # a path given here enters here
    layout = _family(model_type).adapters
    config = _read_config(path)
    _check_config(config, cfg, layout)
    kinds = _module_kinds(layout, cfg)
    named = _named_modules(config, kinds)
    tensors = _read_tensors(path)
    rslora = bool(config.get("use_rslora"))
    experts = _expert_adapters(config, tensors, cfg, layout)  # taken out of ``tensors``
    prefix = layout.layers
    excluded = {(i, kind) for i in range(cfg.layers) for kind in kinds
                if _excluded(config.get("exclude_modules"), f"{prefix}.{i}.{kind}")}
    modules = (_modules(tensors, cfg, prefix, kinds, excluded)
               if tensors or not experts else set())
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
        d_in, d_out = layout.dims(cfg)[kind]
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
    adapters = _trainrun_adapters(found, cfg, layout, int(config.get("r", 8)))
    adapters.update(experts)
    return _settings(adapters)


ExpertPair = tuple[int, np.ndarray, np.ndarray, float]  # layer, PEFT's A and B, its scaling


def _expert_adapters(config: dict[str, Any], tensors: dict[str, np.ndarray],
                     cfg: TransformerModel, layout: AdapterLayout
                     ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
    """(layer, trainrun target) -> (a, b, scale) of the adapters on a mixture's experts and
    router (``target_parameters``), their tensors taken out of ``tensors``; an adapter that
    does not fit the model is refused in one line."""
    wanted = _target_parameters(config, cfg, layout)
    if not wanted:
        return {}
    assert cfg.experts is not None
    experts = cfg.experts
    found = {kind: _expert_pairs(config, tensors, cfg, kind, DOWN in wanted) for kind in wanted}
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] = {}
    for i, a_t, b_t, scale in found.get(ROUTER, []):
        out[i, "router"] = (a_t.T, b_t.T, scale)
    for i, a_t, b_t, scale in found.get(DOWN, []):
        a_e, b_e = _from_per_expert(a_t, b_t, experts)
        out[i, "down"] = (np.swapaxes(a_e, 1, 2), np.swapaxes(b_e, 1, 2), scale)
    out.update(_gate_up_adapters(found.get(GATE_UP, []), cfg, int(config.get("r", 8))))
    for name in sorted(tensors):
        if re.fullmatch(r"model\.layers\.\d+\.mlp\.(experts(\.base_layer)?|gate)\..*", name):
            raise WeightsError(f"tensor {PREFIX}{name} adapts an expert parameter that "
                               "target_parameters does not name (or a dense layer); the file "
                               "does not match its config")
    return out


def _expert_pairs(config: dict[str, Any], tensors: dict[str, np.ndarray],
                  cfg: TransformerModel, kind: str, nested: bool) -> list[ExpertPair]:
    """Each expert layer's PEFT pair on the mixture's parameter ``kind``, taken out of
    ``tensors`` (``nested``: the first of two parameters of one module nests inside the
    second's wrapper)."""
    assert cfg.experts is not None
    experts, rslora = cfg.experts, bool(config.get("use_rslora"))
    d, width = cfg.d_model, cfg.expert_width
    where = {GATE_UP: "mlp.experts.base_layer" if nested else "mlp.experts",
             DOWN: "mlp.experts", ROUTER: "mlp.gate"}[kind]
    d_in, d_out = {GATE_UP: (d, 2 * width), DOWN: (width, d), ROUTER: (d, experts)}[kind]
    per = 1 if kind == ROUTER else experts  # a router's adapter is one plain pair
    found: list[ExpertPair] = []
    for i in range(cfg.layers):
        module = f"model.layers.{i}.{where}"
        names = (f"{module}.lora_A.weight", f"{module}.lora_B.weight")
        if not cfg.expert_layer(i):
            continue
        for name in names:
            if name not in tensors:
                raise WeightsError(f"tensor {PREFIX}{name} is missing; target_parameters "
                                   f"names {kind.rsplit('.', 1)[0] if kind == ROUTER else kind}"
                                   " and trainrun adapts it in every expert layer")
        a_t, b_t = tensors.pop(names[0]), tensors.pop(names[1])
        r = a_t.shape[0] // per
        if r < 1 or a_t.shape != (r * per, d_in) or b_t.shape != (d_out, r * per):
            raise WeightsError(f"{module} has lora_A {a_t.shape} and lora_B {b_t.shape}; "
                               f"the model's {kind} needs [r x {per}, {d_in}] and "
                               f"[{d_out}, r x {per}] (is the adapter for this base model?)")
        full = f"model.layers.{i}.{kind.removesuffix('.weight')}"
        want_r = _pattern(config.get("rank_pattern"), full, config.get("r", 8))
        if r != want_r:
            raise WeightsError(f"{module} has rank {r} but adapter_config.json says "
                               f"{want_r}; the file does not match its config")
        alpha = _pattern(config.get("alpha_pattern"), full, config.get("lora_alpha", 8))
        found.append((i, a_t, b_t, alpha / (math.sqrt(r) if rslora else r)))
    return found


def _gate_up_adapters(pairs: list[ExpertPair], cfg: TransformerModel, rank: int
                      ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
    """The experts' gate and up adapters of each layer's joined ``gate_up_proj`` pair."""
    assert cfg.experts is not None
    width = cfg.expert_width
    layers = [(i, *_from_per_expert(a_t, b_t, cfg.experts), scale)
              for i, a_t, b_t, scale in pairs]
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] = {}
    if not layers:
        return out
    columns = _fused_columns([b for _, _, b_e, _ in layers for b in b_e],
                             {"gate": (0, width), "up": (width, 2 * width)}, rank)
    for i, a_e, b_e, scale in layers:
        for t, (lo, hi) in (("gate", (0, width)), ("up", (width, 2 * width))):
            cols = columns[t]
            if cols is not None:
                out[i, t] = (np.swapaxes(a_e[:, cols], 1, 2),
                             np.swapaxes(b_e[:, lo:hi][:, :, cols], 1, 2), scale)
    return out


def _target_parameters(config: dict[str, Any], cfg: TransformerModel, layout: AdapterLayout
                       ) -> list[str]:
    """The experts' parameters (``GATE_UP``, ``DOWN``, ``ROUTER``) ``target_parameters``
    names, each matched as PEFT matches it (the whole name or a dotted suffix of it)."""
    entries = config.get("target_parameters") or []
    if not entries:
        return []
    if not layout.experts or cfg.experts is None:
        raise WeightsError("adapter_config.json sets target_parameters, which trainrun reads "
                           "for a mixture of experts' experts and router only; train with "
                           "target_modules")
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise WeightsError("adapter_config.json's target_parameters is not a list of names; "
                           "correct it, or save the adapter again with PEFT's save_pretrained")
    wanted = []
    for entry in entries:
        hits = [kind for kind in EXPERT_KINDS
                if f"model.layers.0.{kind}" == entry or kind == entry
                or f"model.layers.0.{kind}".endswith("." + entry)]
        if not hits:
            raise WeightsError(f"target_parameters entry {entry!r} is not a parameter trainrun "
                               f"adapts ({', '.join(EXPERT_KINDS)}); train the adapter "
                               "without it")
        wanted += [kind for kind in hits if kind not in wanted]
    return [kind for kind in EXPERT_KINDS if kind in wanted]


def _settings(adapters: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]
              ) -> tuple[LoraSettings, dict[str, np.ndarray]]:
    """One rank and alpha for all of ``adapters`` ((layer, target) -> (a, b, scale)); a module
    whose scale differs from the first's has its b scaled to match, which is exact."""
    ranks = {(t, a.shape[-1]) for (_, t), (a, _, _) in adapters.items()}  # over every layer
    if len({r for _, r in ranks}) > 1:
        listed = ", ".join(f"{t} {r}" for t, r in sorted(ranks, key=_target_order))
        raise WeightsError(f"the adapter's ranks differ ({listed}; rank_pattern?); trainrun has "
                           "one rank for every adapter: train the adapter with one r")
    rank = next(iter(ranks))[1]
    first = min(adapters, key=lambda key: (key[0], _target_order((key[1], 0))))
    scale = adapters[first][2]
    out: dict[str, np.ndarray] = {}
    for (i, t), (a, b, s) in adapters.items():
        part = "attn" if t in ("q", "k", "v", "o", "qkv") else "mlp"
        out[f"blocks.{i}.{part}.{t}_lora.a"] = np.ascontiguousarray(a, np.float32)
        out[f"blocks.{i}.{part}.{t}_lora.b"] = np.ascontiguousarray(
            b if s == scale else b * np.float32(s / scale), np.float32)
    named = {t for u, _ in ranks for t in FUSED_TARGETS.get(u, (u,))}
    targets: tuple[LoraTarget, ...] = tuple(t for t in TARGETS if t in named)
    return LoraSettings(rank=rank, alpha=scale * rank, targets=targets), out


def _trainrun_adapters(found: dict[str, list[tuple[np.ndarray, np.ndarray, float]]],
                       cfg: TransformerModel, layout: AdapterLayout, rank: int
                       ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]]:
    """(layer, trainrun target) -> (a, b, scale) from PEFT's per-module (A, B, scale)."""
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray, float]] = {}
    for t, kind in _module_table(layout, cfg).items():
        for i, (a_t, b_t, s) in enumerate(found.get(kind, ())):
            out[i, t] = (a_t.T, b_t.T, s)
    if layout.joined is not None and layout.joined in found:
        d = cfg.d_model
        layers = found[layout.joined]
        columns = _fused_columns([b_t for _, b_t, _ in layers],
                                 {t: (j * d, (j + 1) * d) for j, t in enumerate("qkv")}, rank)
        for i, (a_t, b_t, s) in enumerate(layers):
            for j, t in enumerate("qkv"):
                if columns[t] is not None:
                    cols = columns[t]
                    out[i, t] = (a_t[cols].T, b_t[j * d:(j + 1) * d, cols].T, s)
    return out


def _fused_columns(bs: list[np.ndarray], spans: dict[str, tuple[int, int]], rank: int
                   ) -> dict[str, Any]:
    """Which of a fused layer's rank components each of its parts (``spans``: rows of ``B``)
    uses. An adapter that trainrun wrote (or any whose B gives each part columns of its own)
    splits back into the parts that have columns, at their own rank; any other gives every part
    all of them, or, when B is all zero, the config's rank ``rank`` of them."""
    r = bs[0].shape[1]
    used = {t: np.zeros(r, bool) for t in spans}
    for b_t in bs:
        for t, (lo, hi) in spans.items():
            used[t] |= np.any(b_t[lo:hi] != 0, axis=0)
    shared = np.sum([u.astype(int) for u in used.values()], axis=0)
    if shared.max() == 1:
        return {t: np.flatnonzero(u) if u.any() else None for t, u in used.items()}
    if shared.max() == 0:  # B all zero (untrained): any r of A's rows give the same zero delta
        return {t: np.arange(min(r, rank)) for t in spans}
    return {t: np.arange(r) for t in spans}  # dense: each part takes every column


def _check_config(config: dict[str, Any], cfg: TransformerModel, layout: AdapterLayout
                  ) -> None:
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
    _target_parameters(config, cfg, layout)
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


def _modules(tensors: dict[str, np.ndarray], cfg: TransformerModel, prefix: str,
             kinds: tuple[str, ...], excluded: set[tuple[int, str]]) -> set[str]:
    """The module kinds (e.g. ``self_attn.q_proj``) that carry adapters; every tensor must be
    one of theirs, and every layer but those ``excluded`` must have both of each kind's
    (``prefix``: the layers' path)."""
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
    if not (path / ADAPTER_CONFIG).is_file():
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
    if not weights.is_file():
        if (path / ADAPTER_BIN).is_file():
            raise WeightsError(f"{path} has {ADAPTER_BIN} (a pickle) but no {ADAPTER_WEIGHTS}; "
                               "save it with save_pretrained(..., safe_serialization=True)")
        raise WeightsError(f"{path} has no {ADAPTER_WEIGHTS}; PeftModel.save_pretrained "
                           "writes it")
    local = weights.model_file(WeightsError).local_path
    if local is not None:  # safetensors says "No such file" for a denied read
        refuse_unreadable(local)
    data = read_file(weights) if local is None else None
    try:
        tensors = load_file(str(local)) if data is None else load(data)
    except (SafetensorError, ValueError, OSError) as err:
        raise WeightsError(f"cannot read {weights} ({err}); is it complete? save it "
                           "again".replace("\n", " ")) from None
    for name, value in sorted(tensors.items()):
        if value.dtype.kind != "f":  # an integer or boolean tensor would be trained as floats
            raise WeightsError(f"tensor {name} in {weights} has dtype {value.dtype}; LoRA "
                               "weights are floats: save the adapter's float weights")
    return {name.removeprefix(PREFIX): np.asarray(value, np.float32)
            for name, value in tensors.items()}


def _module_table(layout: AdapterLayout, cfg: TransformerModel) -> dict[str, str]:
    """trainrun's adapter (a target, or a fused ``qkv``/``gate_up``) -> the HF module kind
    inside a decoder layer that carries it as a plain LoRA pair."""
    table = dict(layout.modules)
    if layout.joined is not None:  # q, k and v travel joined: _trainrun_adapters
        return table
    if cfg.fused_projections:
        table = {t: kind for t, kind in table.items() if t in ("o", "down")}
        table.update(layout.fused)
    if cfg.experts is not None:  # the experts' adapters are parameters': _expert_adapters
        table = {t: kind for t, kind in table.items() if t in ("q", "k", "v", "o")}
    return table


def _module_kinds(layout: AdapterLayout, cfg: TransformerModel) -> tuple[str, ...]:
    kinds = tuple(_module_table(layout, cfg).values())
    return kinds if layout.joined is None else (layout.joined, *kinds)


def _pattern(patterns: Any, module: str, default: Any) -> float:
    """PEFT's per-module override: the first key of ``patterns`` that matches the module's name
    or a dotted suffix of it (peft.utils.other.get_pattern_key)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(default)


def _adapter(params: PyTree, i: int, target: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``i``'s adapter ``target`` (a fused one: ``qkv``, ``gate_up``): its ``a`` and
    ``b``, ``[experts, ...]`` for an expert's."""
    part = "attn" if target in ("q", "k", "v", "o", "qkv") else "mlp"
    name = f"blocks.{i}.{part}.{target}_lora"
    try:
        blocks = params["blocks"]
        adapter = (blocks[str(i)] if str(i) in blocks else blocks[i])[part][f"{target}_lora"]
        a, b = np.asarray(adapter["a"], np.float32), np.asarray(adapter["b"], np.float32)
    except (KeyError, TypeError, IndexError):
        raise WeightsError(f"params have no {name}.a/.b; are they the adapted model's?") from None
    if (a.ndim not in (2, 3) or b.ndim != a.ndim or a.shape[-1] != rank
            or b.shape[-2] != rank):
        raise WeightsError(f"{name} has a {a.shape} and b {b.shape}; model.lora.rank is {rank}")
    return a, b


def _check_family(cfg: TransformerModel, family: Family, targets: list[str]) -> None:
    """Adapters the family's adapter directory cannot hold are refused in one line (a config
    checks them before training: ``TransformerModel``; a run of older trainrun may not
    have)."""
    model_type, layout = family.model_type, family.adapters
    if cfg.fused_projections and not layout.fused:
        raise WeightsError(f"the model's adapters span fused q/k/v and gate/up layers, which a "
                           f"{model_type} model does not have; export with --merge")
    split = [t for t in targets if t in ("q", "k", "v", "gate", "up")]
    if layout.fused and split and not cfg.fused_projections:
        fused = " and ".join(module.rsplit(".", 1)[1] for module in layout.fused.values())
        raise WeightsError(f"LoRA on {', '.join(split)} of a {model_type} model does not "
                           f"export: {family.title} fuses them into {fused}, and these "
                           "adapters are separate; export with --merge")
    if cfg.experts is not None and not layout.experts:
        raise WeightsError(f"the model has experts, which a {model_type} model does not; "
                           "export with --merge")


def _put_experts(tensors: dict[str, np.ndarray], params: PyTree, cfg: TransformerModel, i: int,
                 targets: list[str]) -> None:
    """Layer ``i``'s adapters on its experts and router as PEFT's ``ParamWrapper`` tensors."""
    assert cfg.lora is not None and cfg.experts is not None
    rank, experts = cfg.lora.rank, cfg.experts
    moe = f"model.layers.{i}.mlp"
    joined = [t for t in ("gate", "up") if t in targets]
    # Two parameters of one module nest: the first one's wrapper is the second's base layer.
    both = bool(joined) and "down" in targets
    if joined:
        pairs = [_adapter(params, i, t, rank) for t in joined]
        width = pairs[0][1].shape[-1]
        a_e = np.concatenate([np.swapaxes(a, 1, 2) for a, _ in pairs], axis=1)  # [E, R, d]
        b_e = np.zeros((experts, 2 * width, rank * len(joined)), np.float32)
        for n, (t, (_, b)) in enumerate(zip(joined, pairs, strict=True)):
            rows = slice(0, width) if t == "gate" else slice(width, 2 * width)
            b_e[:, rows, n * rank:(n + 1) * rank] = np.swapaxes(b, 1, 2)
        _put(tensors, f"{moe}.experts{'.base_layer' if both else ''}", *_per_expert(a_e, b_e))
    if "down" in targets:
        a, b = _adapter(params, i, "down", rank)
        _put(tensors, f"{moe}.experts", *_per_expert(np.swapaxes(a, 1, 2), np.swapaxes(b, 1, 2)))
    if "router" in targets:
        a, b = _adapter(params, i, "router", rank)
        _put(tensors, f"{moe}.gate", a.T, b.T)


def _per_expert(a_e: np.ndarray, b_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's ``lora_A`` ``[r x experts, d_in]`` and ``lora_B`` ``[d_out, r x experts]`` from
    each expert's ``A`` ``[experts, r, d_in]`` and ``B`` ``[experts, d_out, r]``."""
    experts, r, d_in = a_e.shape
    lora_a = a_e.reshape(experts * r, d_in)
    lora_b = np.transpose(b_e, (1, 2, 0)).reshape(b_e.shape[1], r * experts)
    return lora_a, lora_b


def _from_per_expert(lora_a: np.ndarray, lora_b: np.ndarray, experts: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Each expert's ``A`` ``[experts, r, d_in]`` and ``B`` ``[experts, d_out, r]`` from PEFT's
    tensors (``_per_expert`` undone)."""
    r = lora_a.shape[0] // experts
    a_e = lora_a.reshape(experts, r, lora_a.shape[1])
    b_e = np.transpose(lora_b.reshape(lora_b.shape[0], r, experts), (2, 0, 1))
    return a_e, b_e


def _put(tensors: dict[str, np.ndarray], module: str, lora_a: np.ndarray,
         lora_b: np.ndarray) -> None:
    tensors[f"{PREFIX}{module}.lora_A.weight"] = lora_a
    tensors[f"{PREFIX}{module}.lora_B.weight"] = lora_b


def _family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise WeightsError(f"model_type {model_type!r} has no PEFT adapter layout in trainrun; "
                           f"it knows {', '.join(MODEL_TYPES)}")
    return FAMILIES[model_type]


def _number(value: float) -> int | float:
    """An integral alpha as an int, as PEFT's configs write it."""
    return int(value) if float(value).is_integer() else float(value)


def _target_order(item: tuple[str, int]) -> tuple[int, int]:
    """(target, rank) in trainrun's order of targets; a fused adapter where its first is."""
    target = FUSED_TARGETS[item[0]][0] if item[0] in FUSED_TARGETS else item[0]
    return TARGETS.index(target), item[1]
