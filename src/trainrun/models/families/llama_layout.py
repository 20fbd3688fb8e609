"""The Llama layout most families share: RMSNorm, rotary positions, a gated MLP, ``Linear``
layers stored ``[out, in]`` (transposed into Flax's kernels), names under ``model.``. What sets
a family apart is data (``LlamaLayout``: which biases, q/k norms, Gemma's 1 + w norms, fused
projections, how sliding windows are said, a mixture's experts), from which ``family`` builds
its ``Family``: config.json both ways, tensor names both ways, PEFT's adapter modules."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import pydantic
from pydantic import Field

from trainrun.config import RopeScaling, TransformerModel
from trainrun.models.families.experts_layout import ExpertLayout, expert_sources
from trainrun.models.families.family import (
    CONFIG,
    HEAD,
    AdapterLayout,
    Architecture,
    Family,
    Source,
    WeightsError,
    checked_fields,
    never,
    padding_row,
)
from trainrun.models.hf_config import (
    COUNT,
    FLAG,
    POSITIVE,
    Count,
    Flag,
    Index,
    ModelConfig,
    Positive,
    RopeParameters,
    Text,
    TokenId,
)

EMBEDDING = "model.embed_tokens.weight"
ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}
# trainrun target -> the module inside a decoder layer that carries its LoRA adapter
ADAPTER_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                   "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                   "down": "mlp.down_proj"}
# Phi-3's fused layers: trainrun's fused adapter -> its module
FUSED_MODULES = {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}


class LlamaConfig(ModelConfig):
    """The keys of a config.json of the Llama layout's families that trainrun reads."""

    hidden_size: Count | None = Field(default=None, description=COUNT)
    num_hidden_layers: Count | None = Field(default=None, description=COUNT)
    num_attention_heads: Count | None = Field(default=None, description=COUNT)
    num_key_value_heads: Count | None = Field(default=None, description=COUNT)
    head_dim: Count | None = Field(default=None, description=COUNT)
    intermediate_size: Count | None = Field(default=None, description=COUNT)
    max_position_embeddings: Count | None = Field(default=None, description=COUNT)
    rms_norm_eps: Positive | None = Field(default=None, description=POSITIVE)
    rope_theta: Positive | None = Field(default=None, description=POSITIVE)
    rope_scaling: RopeParameters | None = Field(
        default=None, description="an object of rotary settings (rope_type, factor, ...)")
    hidden_act: Text | None = Field(default=None, description="an activation's name")
    attention_bias: Flag | None = Field(default=None, description=FLAG)
    mlp_bias: Flag | None = Field(default=None, description=FLAG)
    sliding_window: Index | None = Field(default=None, description="a whole number from 0")
    use_sliding_window: Flag | None = Field(default=None, description=FLAG)
    max_window_layers: Index | None = Field(default=None, description="a whole number from 0")
    layer_types: list[Text] | None = Field(default=None, description="a list of layer kinds' names")
    hidden_activation: Text | None = Field(default=None, description="an activation's name")
    query_pre_attn_scalar: Positive | None = Field(default=None, description=POSITIVE)
    rope_local_base_freq: Positive | None = Field(default=None, description=POSITIVE)
    decoder_sparse_step: Count | None = Field(default=None, description=COUNT)
    pad_token_id: TokenId | None = Field(
        default=None, description="a token's id (negative: from the end), or null")

    @pydantic.model_validator(mode="after")
    def _heads_divide(self) -> LlamaConfig:
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv_heads is not None and heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}; each key/value head serves a "
                             "group of query heads")
        return self


def _no_layer_types(hf: dict[str, Any], layers: int) -> list[str] | None:
    return None


def _refuses_nothing(hf: dict[str, Any]) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class LlamaLayout:
    """What sets one family of the Llama layout apart (transformers' modeling files).

    qkv_bias: biases on q/k/v alone; attention_bias, mlp_bias: whether its config.json may
    turn those biases on; qk_norm: RMSNorm on queries and keys, over each head or over the
    whole projection (qk_norm_over); activation_key and default_activation: the MLP's
    activation's key and value where absent; norm_plus_one, post_norms, embed_scale: Gemma's
    1 + w norms, norms after each sublayer, scaled embeddings; pre_norms: norms before each
    sublayer (OLMo-2 has none); softcaps: whether attention and output logits are
    soft-capped by attn_logit_softcapping and final_logit_softcapping, and their caps where
    config.json lacks the keys (Gemma 2: 50 and 30; None: no caps); query_scale_key: the key
    of the attention's scalar (1/sqrt of it scales the queries); rope_per_layer_type:
    rope_parameters written per layer type (the local layers' base apart); tie_default:
    tie_word_embeddings where absent; sliding: how a window is said (on every layer from
    sliding_window alone, or per layer in layer_types); layer_types: the layer types an older
    config.json implies without the key; global_window: the window written (unused) where
    every layer is global; refuse: the family's own refusals; fused: one qkv_proj and one
    gate_up_proj per layer; experts: a mixture's experts; pad_default: ``pad_token_id`` where
    config.json lacks it (transformers' config class's default); classifier: the architectures
    entry of its ``...ForSequenceClassification`` (None: ``architecture``'s, ``ForCausalLM``
    made ``ForSequenceClassification``)."""

    model_type: str
    title: str
    architecture: str  # config.json's architectures entry
    classifier: str | None = None
    qkv_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_over: Literal["head", "projection"] = "head"
    activation_key: str = "hidden_act"
    default_activation: str = "silu"
    norm_plus_one: bool = False
    pre_norms: bool = True
    post_norms: bool = False
    softcaps: tuple[float | None, float | None] | None = None  # (attention, final)
    embed_scale: bool = False
    query_scale_key: str | None = None
    rope_per_layer_type: bool = False
    tie_default: bool = False
    sliding: Literal["none", "every_layer", "layer_types"] = "none"
    layer_types: Callable[[dict[str, Any], int], list[str] | None] = _no_layer_types
    global_window: int | None = None
    refuse: Callable[[dict[str, Any]], None] = _refuses_nothing
    fused: bool = False
    experts: ExpertLayout | None = None
    pad_default: int | None = None


# ---- config.json -> the transformer ------------------------------------------------------------


def fields(hf: dict[str, Any], layout: LlamaLayout) -> Architecture:
    """The transformer a config.json of ``layout``'s family describes; what trainrun cannot
    compute is refused in one line naming it."""
    act_key = layout.activation_key
    activation = hf.get(act_key, layout.default_activation)
    if activation not in ACTIVATIONS:
        raise WeightsError(f"{act_key} {activation!r} is not supported; trainrun's gated MLPs "
                           "take silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)")
    for key, allowed in (("attention_bias", layout.attention_bias),
                         ("mlp_bias", layout.mlp_bias)):
        if hf.get(key) and not allowed:
            raise WeightsError(f"{key}=true is not supported for {layout.model_type}: "
                               f"transformers' {layout.model_type} layers have no such biases")
    layout.refuse(hf)
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    layers = int(hf["num_hidden_layers"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or d // heads)
    theta, scaling, local_theta = rope(hf)
    window, sliding = sliding_layers(hf, layout, layers)
    keys = {"vocab": "vocab_size", "d_model": "hidden_size", "layers": "num_hidden_layers",
            "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "mlp_hidden": "intermediate_size",
            "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "rope_scaling": "rope_scaling", "tie_embeddings": "tie_word_embeddings",
            "mlp": act_key, "sliding_window": "sliding_window", "sliding_layers": "layer_types",
            "fused_projections": "model_type",
            "attention_logit_softcap": "attn_logit_softcapping",
            "final_logit_softcap": "final_logit_softcapping", "pad_id": "pad_token_id"}
    values = {"vocab": int(hf["vocab_size"]), "d_model": d, "layers": layers,
              "heads": heads, "kv_heads": kv_heads if kv_heads != heads else None,
              "head_dim": head_dim if head_dim * heads != d else None,
              "mlp": ACTIVATIONS[activation], "mlp_hidden": int(hf["intermediate_size"]),
              "norm": "rmsnorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
              "positions": "rope", "rope_theta": theta, "rope_scaling": scaling, "bias": False,
              "qkv_bias": layout.qkv_bias,
              "attention_bias": bool(hf.get("attention_bias", False)),
              "mlp_bias": bool(hf.get("mlp_bias", False)),
              "qk_norm": layout.qk_norm, "norm_plus_one": layout.norm_plus_one,
              "qk_norm_over": layout.qk_norm_over, "pre_norms": layout.pre_norms,
              "post_norms": layout.post_norms, "embed_scale": layout.embed_scale,
              **_softcaps(hf, layout),
              "query_scale": (float(hf.get(layout.query_scale_key, head_dim)) ** -0.5
                              if layout.query_scale_key else None),
              "sliding_window": window, "sliding_layers": sliding,
              "fused_projections": layout.fused,
              "local_rope_theta": local_theta if window is not None else None,
              "tie_embeddings": bool(hf.get("tie_word_embeddings", layout.tie_default)),
              "pad_id": padding_row(hf, layout.pad_default)}
    if layout.experts is not None:
        values.update(layout.experts.fields(hf, layers))
        keys.update(layout.experts.keys)
    return Architecture(layout.model_type, values, keys,
                        int(hf.get("max_position_embeddings") or 0))


def _softcaps(hf: dict[str, Any], layout: LlamaLayout) -> dict[str, float | None]:
    """The attention's and the output head's soft-caps: the keys' values, the family's
    defaults where they are absent (None: none, as a null key says)."""
    caps = {"attention_logit_softcap": "attn_logit_softcapping",
            "final_logit_softcap": "final_logit_softcapping"}
    defaults = layout.softcaps or (None, None)
    values = [hf.get(key, default) if layout.softcaps else None
              for key, default in zip(caps.values(), defaults, strict=True)]
    return {field: None if value is None else float(value)
            for field, value in zip(caps, values, strict=True)}


def sliding_layers(hf: dict[str, Any], layout: LlamaLayout, layers: int
                   ) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers it applies to, None: every layer) as transformers builds the
    family's masks: from ``layer_types`` where the config has them (or implies them), else on
    every layer where ``sliding_window`` is set and the family says a window so."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None:
        types = layout.layer_types(hf, layers)
    if types is not None:
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise WeightsError(f"layer_types {types!r} is not one of sliding_attention or "
                               f"full_attention per layer ({layers} layers)")
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        if not sliding:
            return None, None
        if not window:
            raise WeightsError("layer_types names sliding_attention layers but sliding_window "
                               "is not set; give the window's length")
        return int(window), None if len(sliding) == layers else sliding
    if layout.sliding == "every_layer" and window:
        return int(window), None
    return None, None


def rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling, the local layers' theta) from ``rope_theta`` and ``rope_scaling`` (the
    form hub checkpoints carry) or ``rope_parameters`` (the form ``transformers`` 5 writes;
    per layer type where local layers have a base of their own, unscaled)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local = hf.get("rope_local_base_freq")
    if "full_attention" in params or "sliding_attention" in params:
        sliding = dict(params.get("sliding_attention") or {})
        if sliding.get("rope_type", "default") != "default":
            raise WeightsError(f"rope_parameters.sliding_attention has rope_type "
                               f"{sliding['rope_type']!r}; trainrun's local layers take the "
                               "default rotary scheme")
        local = sliding.get("rope_theta", local)
        params = dict(params.get("full_attention") or {})
    elif params and "rope_type" not in params and "type" not in params \
            and "rope_theta" not in params:
        raise WeightsError("rope_parameters per layer type other than full_attention and "
                           "sliding_attention are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    local_theta = None if local is None else float(local)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return theta, None, local_theta
    if kind == "linear":
        return theta, RopeScaling(type="linear", factor=float(params["factor"])), local_theta
    if kind == "llama3":
        return theta, RopeScaling(
            type="llama3", factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_positions=int(params["original_max_position_embeddings"])), local_theta
    raise WeightsError(f"rope_scaling type {kind!r} is not supported; trainrun computes "
                       "default, linear and llama3 rotary frequencies")


# ---- the transformer -> config.json ------------------------------------------------------------


def rope_json(cfg: TransformerModel) -> dict[str, Any]:
    """``rope_parameters`` of the model's (global) layers."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type == "linear":
        rope = {**rope, "rope_type": "linear", "factor": scaling.factor}
    elif scaling is not None:
        rope = {**rope, "rope_type": "llama3", "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_positions}
    return rope


DROPPED = ("rope_scaling", "rope_theta", "rope_local_base_freq", "layer_types",
           "use_sliding_window", "max_window_layers", "sliding_window")  # written anew


def config_json(cfg: TransformerModel, source: dict[str, Any] | None,
                layout: LlamaLayout) -> dict[str, Any]:
    """A config.json of ``layout``'s family for ``cfg`` over ``source``'s other fields; a model
    the family's config.json cannot say is refused in one line (``refuse_unwritten``)."""
    rope = rope_json(cfg)
    out = {k: v for k, v in (source or {}).items() if k not in DROPPED}
    out.update({
        "model_type": layout.model_type, "architectures": [layout.architecture],
        "vocab_size": cfg.vocab, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_key_heads,
        "head_dim": cfg.attention_head_dim, "intermediate_size": cfg.hidden,
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "pad_token_id": cfg.pad_id})
    out[layout.activation_key] = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}.get(cfg.mlp,
                                                                                        cfg.mlp)
    if layout.attention_bias:
        out["attention_bias"] = cfg.attention_bias
    if layout.mlp_bias:
        out["mlp_bias"] = cfg.mlp_bias
    if layout.query_scale_key:
        out[layout.query_scale_key] = _query_scalar(cfg)
    if layout.softcaps is not None:
        out["attn_logit_softcapping"] = cfg.attention_logit_softcap
        out["final_logit_softcapping"] = cfg.final_logit_softcap
    if layout.rope_per_layer_type:
        local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    _window_json(cfg, out, layout)
    if layout.experts is not None:
        out.update(layout.experts.json(cfg))
    out["max_position_embeddings"] = max(int(out.get("max_position_embeddings") or 0),
                                         cfg.seq_len)
    if cfg.rope_scaling is not None and not layout.rope_per_layer_type:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}  # older key
    refuse_unwritten(cfg, out, layout)
    return out


def _query_scalar(cfg: TransformerModel) -> float | int:
    """The attention's scalar whose 1/sqrt scales the queries (``query_pre_attn_scalar``)."""
    scalar = cfg.attention_head_dim if cfg.query_scale is None else cfg.query_scale ** -2
    # transformers takes a whole number here; 1/sqrt round trips within float error
    return round(scalar) if math.isclose(scalar, round(scalar)) else scalar


def _window_json(cfg: TransformerModel, out: dict[str, Any], layout: LlamaLayout) -> None:
    """The sliding window's keys, as the family says a window (or its absence)."""
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
        if layout.sliding == "layer_types":
            out["layer_types"] = ["sliding_attention" if cfg.local_layer(i) else
                                  "full_attention" for i in range(cfg.layers)]
            out["use_sliding_window"] = True
            out["max_window_layers"] = 0
    elif layout.sliding == "every_layer":
        out["sliding_window"] = None
    elif layout.global_window is not None:  # every layer global
        out["sliding_window"] = layout.global_window
        out["layer_types"] = ["full_attention"] * cfg.layers


def refuse_unwritten(cfg: TransformerModel, out: dict[str, Any], layout: LlamaLayout) -> None:
    """A layout the family's config.json cannot say (read back, it would describe another
    model) is refused in one line naming the first field that differs."""
    back = checked_fields(out, CONFIG, LlamaConfig, lambda hf: fields(hf, layout)).fields
    for field, value in back.items():
        if field in ("seq_len",):
            continue
        mine = getattr(cfg, field)
        if field == "kv_heads":
            mine, value = cfg.kv_key_heads, value or cfg.heads
        elif field == "head_dim":
            mine, value = cfg.attention_head_dim, value or cfg.d_model // cfg.heads
        elif field == "mlp_hidden":
            mine = cfg.hidden
        elif field == "query_scale" and value is not None and mine is None:
            mine = cfg.attention_head_dim ** -0.5
        if isinstance(mine, float) and isinstance(value, float) and math.isclose(mine, value):
            continue
        if mine != value and not (field == "local_rope_theta" and mine is None):
            raise WeightsError(f"the model has {field}={mine!r}, which a {layout.model_type} "
                               f"config.json cannot say (it would read {value!r}): export it "
                               "as the family it was trained from")


# ---- tensors -----------------------------------------------------------------------------------


def tensor_map(cfg: TransformerModel, layout: LlamaLayout) -> dict[str, Source]:
    """trainrun's dotted param name -> its tensor in the family's layout."""
    names = {"embed.embedding": Source(EMBEDDING), "ln_f.scale": Source("model.norm.weight")}
    for i in range(cfg.layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        names.update(_attention_sources(cfg, layout, hf, ours))
        if cfg.expert_layer(i):
            names.update(expert_sources(cfg, layout.experts, hf, f"{ours}mlp."))
            continue
        names.update(_mlp_sources(cfg, layout, hf, ours))
    if not cfg.tie_embeddings:
        names["head"] = Source(HEAD)
    return names


def _norm_names(cfg: TransformerModel) -> tuple[tuple[str, str], ...]:
    """(trainrun's norm, the family's) of one layer: the norms before attention and MLP (the
    second is post_attention_layernorm where there are none after), those after, or both."""
    post = (("attn_out_norm", "post_attention_layernorm"),
            ("mlp_out_norm", "post_feedforward_layernorm"))
    if not cfg.pre_norms:
        return post if cfg.post_norms else ()
    if cfg.post_norms:
        return (("ln1", "input_layernorm"), ("ln2", "pre_feedforward_layernorm"), *post)
    return (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))


def _attention_sources(cfg: TransformerModel, layout: LlamaLayout, hf: str, ours: str
                       ) -> dict[str, Source]:
    """One layer's norms and attention params' tensors (``hf``: the layer's prefix)."""
    names: dict[str, Source] = {}
    head_dim = cfg.attention_head_dim
    inner, kv_inner = cfg.heads * head_dim, cfg.kv_key_heads * head_dim
    qkv_spans = {"q": (0, inner), "k": (inner, inner + kv_inner),
                 "v": (inner + kv_inner, inner + 2 * kv_inner)}
    for norm, theirs in _norm_names(cfg):
        names[f"{ours}{norm}.scale"] = Source(f"{hf}{theirs}.weight")
    if cfg.qk_norm:
        for proj in "qk":
            names[f"{ours}attn.{proj}_norm.scale"] = Source(f"{hf}self_attn.{proj}_norm.weight")
    for proj in "qkv":
        if layout.fused:
            names[f"{ours}attn.{proj}.kernel"] = Source(
                f"{hf}self_attn.qkv_proj.weight", transpose=True, span=qkv_spans[proj],
                fused=inner + 2 * kv_inner)
        else:
            names[f"{ours}attn.{proj}.kernel"] = Source(f"{hf}self_attn.{proj}_proj.weight",
                                                        transpose=True)
        if cfg.qkv_bias or cfg.attention_bias:
            names[f"{ours}attn.{proj}.bias"] = Source(f"{hf}self_attn.{proj}_proj.bias")
    names[f"{ours}attn.o.kernel"] = Source(f"{hf}self_attn.o_proj.weight", transpose=True)
    if cfg.attention_bias:
        names[f"{ours}attn.o.bias"] = Source(f"{hf}self_attn.o_proj.bias")
    return names


def _mlp_sources(cfg: TransformerModel, layout: LlamaLayout, hf: str, ours: str
                 ) -> dict[str, Source]:
    """One dense layer's MLP params' tensors."""
    names: dict[str, Source] = {}
    for j, proj in enumerate(("gate", "up")):
        if layout.fused:
            names[f"{ours}mlp.{proj}.kernel"] = Source(
                f"{hf}mlp.gate_up_proj.weight", transpose=True,
                span=(j * cfg.hidden, (j + 1) * cfg.hidden), fused=2 * cfg.hidden)
        else:
            names[f"{ours}mlp.{proj}.kernel"] = Source(f"{hf}mlp.{proj}_proj.weight",
                                                       transpose=True)
    names[f"{ours}mlp.down.kernel"] = Source(f"{hf}mlp.down_proj.weight", transpose=True)
    if cfg.mlp_bias:
        for proj in ("gate", "up", "down"):
            names[f"{ours}mlp.{proj}.bias"] = Source(f"{hf}mlp.{proj}_proj.bias")
    return names


def adapter_dims(cfg: TransformerModel) -> dict[str, tuple[int, int]]:
    """Each adapted module's (d_in, d_out)."""
    d, hidden = cfg.d_model, cfg.hidden
    q, kv = cfg.heads * cfg.attention_head_dim, cfg.kv_key_heads * cfg.attention_head_dim
    return {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv), "self_attn.v_proj": (d, kv),
            "self_attn.o_proj": (q, d), "mlp.gate_proj": (d, hidden),
            "mlp.up_proj": (d, hidden), "mlp.down_proj": (hidden, d),
            "self_attn.qkv_proj": (d, q + 2 * kv), "mlp.gate_up_proj": (d, 2 * hidden)}


def family(layout: LlamaLayout, *, writes_fresh: Callable[[TransformerModel], bool] = never,
           reads_bare: Callable[[set[str]], bool] = never) -> Family:
    """The ``Family`` of ``layout`` (``writes_fresh``, ``reads_bare``: as ``Family``'s)."""
    return Family(
        model_type=layout.model_type, title=layout.title, schema=LlamaConfig,
        fields=lambda hf: fields(hf, layout),
        config_json=lambda cfg, source: config_json(cfg, source, layout),
        tensor_map=lambda cfg: tensor_map(cfg, layout), embedding=EMBEDDING,
        adapters=AdapterLayout(layers="model.layers", modules=ADAPTER_MODULES, dims=adapter_dims,
                               fused=FUSED_MODULES if layout.fused else {},
                               experts=layout.experts is not None),
        classifier=layout.classifier or layout.architecture.replace(
            "ForCausalLM", "ForSequenceClassification"),
        writes_fresh=writes_fresh, reads_bare=reads_bare)


def is_llama_layout(cfg: TransformerModel) -> bool:
    """Whether ``cfg`` is the Llama layout's: rotary positions, RMSNorm, a SwiGLU MLP."""
    return cfg.positions == "rope" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu"


def has_fused_names(names: set[str]) -> bool:
    """Whether tensor ``names`` hold fused q/k/v projections (Phi-3's layout)."""
    return any(".self_attn.qkv_proj." in n for n in names)
