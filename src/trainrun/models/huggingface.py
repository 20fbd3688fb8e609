"""Weights in and out of Hugging Face's layout for the GPT-2 and Llama families and their mixtures
of experts (each ``model_type`` of ``MODEL_TYPES``): a model directory of ``config.json`` and
``model.safetensors``, or of shards listed in ``model.safetensors.index.json``, as
``transformers``' ``save_pretrained`` writes it and ``from_pretrained`` reads it. Through
``safetensors`` alone: neither ``transformers`` nor PyTorch is imported.

A model directory may be on object storage (``gs://``, ``s3://``): its files are read through
the storage layer, each shard's header and tensors by ranged reads, never copied whole.

``config.json`` gives the architecture: every field that changes the maths is either carried
into the transformer's config or refused on one line. Tensors are read lazily, a slice at a
time, so a model can be placed shard by shard on a mesh without the host holding it whole. The
tensor-by-tensor mapping: docs/internals.md, "Hugging Face weights"."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import RopeScaling, TransformerModel
from trainrun.errors import UserError, read_refused
from trainrun.models import safetensors_ranges as ranges
from trainrun.models.hf_config import checked_model_config
from trainrun.storage import location, remote

Location = location.Location  # a local path, or a gs:// or s3:// one

PyTree = Any
WEIGHTS, CONFIG, INDEX = "model.safetensors", "config.json", "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
HEAD = "lm_head.weight"
# safetensors' float dtypes that numpy (or JAX, for bfloat16) reads as the values they hold
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
BLOCK_ELEMENTS = 2**24  # of a large table compared a block at a time, never read whole
PREFIX = "transformer."  # GPT2LMHeadModel's body; a bare GPT2Model's names lack it
MOE_FAMILY = ("mixtral", "qwen2_moe", "qwen3_moe")
LLAMA_FAMILY = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "phi3", *MOE_FAMILY)
MODEL_TYPES = ("gpt2", *LLAMA_FAMILY)
# Files a model directory carries beside its weights, copied by an export from its source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", GENERATION_CONFIG)


class WeightsError(UserError):
    """Weights that do not fit the model; the CLI prints it on one line and exits 2."""


# ---- config.json -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a ``config.json`` says of the model: the transformer's fields it sets, with the
    config.json key each came from (for messages), and the longest context it was made for."""

    model_type: str
    fields: dict[str, Any]
    keys: dict[str, str]
    max_positions: int


def architecture(hf: dict[str, Any], where: str = CONFIG) -> Architecture:
    """The transformer a ``config.json`` describes; a value of the wrong type or out of range,
    or a field trainrun cannot compute, is refused in one line naming it."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise WeightsError(f"{where} has model_type {model_type!r}; trainrun reads "
                           + ", ".join(MODEL_TYPES))
    checked_model_config(hf, where)
    if hf.get("quantization_config"):
        raise WeightsError(f"{where} describes quantized weights (quantization_config); "
                           "trainrun reads float weights: give the unquantized model")
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                   hf.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise WeightsError(f"{where} has partial_rotary_factor {partial}; trainrun rotates the "
                           "whole head dimension")
    try:
        return _gpt2(hf) if model_type == "gpt2" else _llama_family(hf, model_type)
    except KeyError as err:
        raise WeightsError(f"{where} lacks {err.args[0]!r}, which a {model_type} config.json "
                           "has; is it complete?") from None
    except (TypeError, ValueError) as err:
        raise WeightsError(f"{where} has a value of the wrong type ({err})") from None


def _gpt2(hf: dict[str, Any]) -> Architecture:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise WeightsError(f"activation_function {activation!r} is not GPT-2's tanh GELU "
                           "(gelu_new), the one trainrun's transformer has")
    if not hf.get("scale_attn_weights", True):
        raise WeightsError("scale_attn_weights=false (attention logits not divided by "
                           "sqrt(head_dim)) is not supported; trainrun's attention scales them")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise WeightsError(f"{key}=true is not supported; trainrun's attention has neither")
    d = int(hf["n_embd"])
    keys = {"vocab": "vocab_size", "d_model": "n_embd", "layers": "n_layer", "heads": "n_head",
            "mlp_hidden": "n_inner", "seq_len": "n_positions",
            "norm_eps": "layer_norm_epsilon", "tie_embeddings": "tie_word_embeddings"}
    fields = {"vocab": int(hf["vocab_size"]), "d_model": d, "layers": int(hf["n_layer"]),
              "heads": int(hf["n_head"]), "kv_heads": None, "head_dim": None,
              "mlp": "gelu", "mlp_hidden": int(hf.get("n_inner") or 4 * d),
              "norm": "layernorm", "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
              "seq_len": int(hf["n_positions"]), "positions": "learned", "bias": True,
              "qkv_bias": False, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
              "rope_scaling": None}
    return Architecture("gpt2", fields, keys, int(hf["n_positions"]))


# What sets each family of the Llama layout apart (transformers' modeling files).
QKV_BIAS = ("qwen2", "qwen2_moe")  # biases on q/k/v alone
ATTENTION_BIAS = ("llama", "qwen3", "gemma3_text", "qwen3_moe")  # on q/k/v and o
MLP_BIAS = ("llama",)  # mlp_bias
QK_NORM = ("qwen3", "gemma3_text", "qwen3_moe")
GEMMA = ("gemma3_text",)  # 1 + w norms, norms after each sublayer, scaled embeddings
FUSED = ("phi3",)  # one qkv_proj and one gate_up_proj per layer
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_tanh": "geglu"}


def _llama_family(hf: dict[str, Any], model_type: str) -> Architecture:
    act_key = "hidden_activation" if model_type in GEMMA else "hidden_act"
    activation = hf.get(act_key, "gelu_pytorch_tanh" if model_type in GEMMA else "silu")
    if activation not in ACTIVATIONS:
        raise WeightsError(f"{act_key} {activation!r} is not supported; trainrun's gated MLPs "
                           "take silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)")
    for key, families in (("attention_bias", ATTENTION_BIAS), ("mlp_bias", MLP_BIAS)):
        if hf.get(key) and model_type not in families:
            raise WeightsError(f"{key}=true is not supported for {model_type}: transformers' "
                               f"{model_type} layers have no such biases")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None and model_type in GEMMA:
            raise WeightsError(f"{key}={hf[key]} is not supported; trainrun's attention and "
                               "output head do not soft-cap")
    if model_type in GEMMA and hf.get("use_bidirectional_attention"):
        raise WeightsError("use_bidirectional_attention=true is not supported; trainrun's "
                           "attention is causal")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    layers = int(hf["num_hidden_layers"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or d // heads)
    theta, scaling, local_theta = _rope(hf)
    window, sliding = _sliding(hf, model_type, layers)
    gemma = model_type in GEMMA
    keys = {"vocab": "vocab_size", "d_model": "hidden_size", "layers": "num_hidden_layers",
            "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "mlp_hidden": "intermediate_size",
            "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "rope_scaling": "rope_scaling", "tie_embeddings": "tie_word_embeddings",
            "mlp": act_key, "sliding_window": "sliding_window", "sliding_layers": "layer_types",
            "fused_projections": "model_type"}
    fields = {"vocab": int(hf["vocab_size"]), "d_model": d, "layers": layers,
              "heads": heads, "kv_heads": kv_heads if kv_heads != heads else None,
              "head_dim": head_dim if head_dim * heads != d else None,
              "mlp": ACTIVATIONS[activation], "mlp_hidden": int(hf["intermediate_size"]),
              "norm": "rmsnorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
              "positions": "rope", "rope_theta": theta, "rope_scaling": scaling, "bias": False,
              "qkv_bias": (bool(hf.get("qkv_bias", True)) if model_type == "qwen2_moe"
                           else model_type in QKV_BIAS),
              "attention_bias": bool(hf.get("attention_bias", False)),
              "mlp_bias": bool(hf.get("mlp_bias", False)),
              "qk_norm": model_type in QK_NORM, "norm_plus_one": gemma, "post_norms": gemma,
              "embed_scale": gemma,
              "query_scale": (float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5
                              if gemma else None),
              "sliding_window": window, "sliding_layers": sliding,
              "fused_projections": model_type in FUSED,
              "local_rope_theta": local_theta if window is not None else None,
              "tie_embeddings": bool(hf.get("tie_word_embeddings",
                                            model_type in ("qwen2", *GEMMA))),
              **(_experts(hf, model_type, layers) if model_type in MOE_FAMILY else {})}
    if model_type in MOE_FAMILY:
        keys.update(experts="num_experts", experts_per_token="num_experts_per_tok",
                    expert_hidden="moe_intermediate_size",
                    shared_expert_hidden="shared_expert_intermediate_size",
                    router_aux_loss="router_aux_loss_coef", dense_layers="mlp_only_layers")
    return Architecture(model_type, fields, keys, int(hf.get("max_position_embeddings") or 0))


def _experts(hf: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    if float(hf.get("router_jitter_noise") or 0.0):
        raise WeightsError(f"router_jitter_noise {hf['router_jitter_noise']} is not supported; "
                           "trainrun's router adds no noise: set it to 0")
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts < 2:
        raise WeightsError(f"num_experts {experts} names no mixture; a dense model has its "
                           "own model_type")
    if model_type == "mixtral":
        return {"experts": experts, "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
                "expert_hidden": None, "router_renormalise": True, "dense_layers": (),
                "shared_expert_hidden": None,
                "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001))}
    step = int(hf.get("decoder_sparse_step", 1))
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = hf.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
    return {"experts": experts, "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
            "expert_hidden": int(hf["moe_intermediate_size"]),
            "router_renormalise": bool(hf.get("norm_topk_prob", model_type == "qwen3_moe")),
            "dense_layers": dense, "shared_expert_hidden": int(shared) if shared else None,
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001))}


def _sliding(hf: dict[str, Any], model_type: str, layers: int
             ) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers it applies to, None: every layer) as transformers' ``model_type``
    builds its masks: from ``layer_types`` where the config has them (Qwen2, Qwen3, Gemma 3),
    else on every layer where ``sliding_window`` is set (Mistral, Phi-3)."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is None and model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        start = int(hf.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if types is None and model_type in GEMMA:
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
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
    if model_type in ("mistral", "phi3", "mixtral") and window:
        return int(window), None
    return None, None


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling, the local layers' theta) from ``rope_theta`` and ``rope_scaling`` (the
    form hub checkpoints carry) or ``rope_parameters`` (the form ``transformers`` 5 writes;
    per layer type for Gemma 3, whose local layers have a base of their own, unscaled)."""
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


def refuse_unsupported(hf: dict[str, Any], seq_len: int, where: str = CONFIG) -> None:
    """What ``config.json`` asks checked before a run of ``seq_len`` tokens uses it (every
    value trainrun reads holds what its key takes; sliding windows are computed)."""
    if hf.get("model_type") in MODEL_TYPES:
        checked_model_config(hf, where)


def config_json(cfg: TransformerModel, model_type: str,
                source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` in ``model_type``'s layout. ``source``: the config.json
    the model was loaded from; every field of it is kept as it was but those whose value for
    the model ``cfg`` changed (``kept_source``)."""
    if model_type == "gpt2":
        if (cfg.positions != "learned" or not cfg.bias or cfg.norm != "layernorm"
                or cfg.mlp != "gelu" or cfg.kv_heads not in (None, cfg.heads)
                or cfg.head_dim not in (None, cfg.d_model // cfg.heads)):
            raise WeightsError("only a transformer with GPT-2's layout exports as gpt2 "
                               "(positions=learned, bias=true, layernorm, gelu MLP, one key/value "
                               "head per head)")
        out = {**(source or {}), "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
               "activation_function": "gelu_new", "vocab_size": cfg.vocab,
               "n_embd": cfg.d_model, "n_layer": cfg.layers, "n_head": cfg.heads,
               "n_inner": cfg.hidden, "n_positions": cfg.seq_len,
               "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
               "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True}
        out.setdefault("bos_token_id", None)
        out.setdefault("eos_token_id", None)
        return kept_source(out, source)
    if model_type not in LLAMA_FAMILY:
        raise WeightsError(f"model_type {model_type!r} is not one trainrun writes; it writes "
                           + ", ".join(MODEL_TYPES))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.type == "linear":
        rope = {**rope, "rope_type": "linear", "factor": scaling.factor}
    elif scaling is not None:
        rope = {**rope, "rope_type": "llama3", "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_positions}
    gemma = model_type in GEMMA
    dropped = ("rope_scaling", "rope_theta", "rope_local_base_freq", "layer_types",
               "use_sliding_window", "max_window_layers", "sliding_window")
    out = {k: v for k, v in (source or {}).items() if k not in dropped}
    out.update({
        "model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
        "vocab_size": cfg.vocab, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_key_heads,
        "head_dim": cfg.attention_head_dim, "intermediate_size": cfg.hidden,
        "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std})
    activation = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}.get(cfg.mlp, cfg.mlp)
    out["hidden_activation" if gemma else "hidden_act"] = activation
    if model_type in ATTENTION_BIAS:
        out["attention_bias"] = cfg.attention_bias
    if model_type in MLP_BIAS:
        out["mlp_bias"] = cfg.mlp_bias
    if gemma:
        scalar = (cfg.attention_head_dim if cfg.query_scale is None
                  else cfg.query_scale ** -2)
        # transformers takes a whole number here; 1/sqrt round trips within float error
        out["query_pre_attn_scalar"] = (round(scalar) if math.isclose(scalar, round(scalar))
                                        else scalar)
        local = {"rope_type": "default",
                 "rope_theta": cfg.local_rope_theta or cfg.rope_theta}
        out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
        if model_type in ("qwen2", "qwen3", *GEMMA):
            out["layer_types"] = ["sliding_attention" if cfg.local_layer(i) else
                                  "full_attention" for i in range(cfg.layers)]
            out["use_sliding_window"] = True
            out["max_window_layers"] = 0
    elif model_type in ("mistral", "phi3", "mixtral"):
        out["sliding_window"] = None
    elif gemma:  # every layer global
        out["sliding_window"] = 4096
        out["layer_types"] = ["full_attention"] * cfg.layers
    if model_type in MOE_FAMILY:
        out.update(_experts_json(cfg, model_type))
    out["max_position_embeddings"] = max(int(out.get("max_position_embeddings") or 0),
                                         cfg.seq_len)
    if scaling is not None and not gemma:  # hub checkpoints' key, read by older transformers
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    _refuse_unwritten(cfg, out, model_type)
    return kept_source(out, source)


def kept_source(out: dict[str, Any], source: dict[str, Any] | None) -> dict[str, Any]:
    """The source's ``config.json`` with ``out``'s value (the model as trained) only where the
    model differs: each field ``architecture`` reads whose value changed, its key written as
    ``out`` writes it, and a longer ``max_position_embeddings``. Every other field stays as the
    source has it (``initializer_range``, keys trainrun does not read, ``rope_theta`` beside
    ``rope_parameters``). ``out`` as it is where there is no source of its model_type, or
    where the source's keys cannot say the change."""
    if not source or source.get("model_type") != out["model_type"]:
        return out
    theirs, ours = architecture(source), architecture(out)
    kept = dict(source)
    for field, value in ours.fields.items():
        if _same(theirs.fields.get(field), value):
            continue
        key = ours.keys.get(field)
        if key is None:
            return out
        for name in ROPE_KEYS if key in ROPE_KEYS else (key,):
            if name in out:
                kept[name] = out[name]
            else:
                kept.pop(name, None)
    if ours.max_positions > theirs.max_positions:
        kept["max_position_embeddings"] = out["max_position_embeddings"]
    back = architecture(kept).fields
    if any(not _same(back.get(field), value) for field, value in ours.fields.items()):
        return out
    return kept


ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")  # one setting, three spellings


def _same(a: object, b: object) -> bool:
    """Equal, floats within rounding (a value read back from JSON)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b)
    return a == b


def _experts_json(cfg: TransformerModel, model_type: str) -> dict[str, Any]:
    if cfg.experts is None:
        raise WeightsError(f"the model has no experts, which {model_type} has: export it as "
                           "the dense family it was trained from")
    out: dict[str, Any] = {"num_experts_per_tok": cfg.experts_per_token,
                           "router_aux_loss_coef": cfg.router_aux_loss,
                           "output_router_logits": False}
    if model_type == "mixtral":
        return {**out, "num_local_experts": cfg.experts}
    out.update(num_experts=cfg.experts, moe_intermediate_size=cfg.expert_width,
               norm_topk_prob=cfg.router_renormalise, decoder_sparse_step=1,
               mlp_only_layers=list(cfg.dense_layers))
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_hidden or 0,
                   qkv_bias=cfg.qkv_bias)
    return out


def _expert_sources(cfg: TransformerModel, model_type: str, hf: str, ours: str
                    ) -> dict[str, Source]:
    """The sources of one expert layer's params (``hf``: the layer's prefix)."""
    assert cfg.experts is not None
    if model_type == "mixtral":
        moe, parts = f"{hf}block_sparse_moe.", {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        moe, parts = f"{hf}mlp.", {p: f"{p}_proj" for p in ("gate", "up", "down")}
    names = {f"{ours}router": Source(f"{moe}gate.weight", transpose=True)}
    for ours_name, theirs in parts.items():
        stack = tuple(f"{moe}experts.{e}.{theirs}.weight" for e in range(cfg.experts))
        names[f"{ours}{ours_name}"] = Source(stack[0], transpose=True, stack=stack)
    if cfg.shared_expert_hidden is not None:
        names[f"{ours}shared_gate"] = Source(f"{moe}shared_expert_gate.weight", transpose=True)
        for p in ("gate", "up", "down"):
            key = "shared_gate_proj" if p == "gate" else f"shared_{p}"
            names[f"{ours}{key}"] = Source(f"{moe}shared_expert.{p}_proj.weight", transpose=True)
    return names


def _refuse_unwritten(cfg: TransformerModel, out: dict[str, Any], model_type: str) -> None:
    """A layout ``model_type``'s config.json cannot say (read back, it would describe another
    model) is refused in one line naming the first field that differs."""
    back = architecture(out).fields
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
            raise WeightsError(f"the model has {field}={mine!r}, which a {model_type} "
                               f"config.json cannot say (it would read {value!r}): export it "
                               "as the family it was trained from")


def read_config(path: Location) -> dict[str, Any]:
    """A model directory's ``config.json`` as a dict; unreadable is one line."""
    file = path / CONFIG
    data = read_file(file)
    try:
        hf = json.loads(data)
    except ValueError as err:  # not JSON, or not UTF-8 text
        raise WeightsError(f"cannot read {file}: {err}".replace("\n", " ")) from None
    if not isinstance(hf, dict):
        raise WeightsError(f"{file} is not a JSON object; is it a Hugging Face config.json?")
    return hf


def read_file(file: Location) -> bytes:
    """A file of a model directory, local or on object storage; a local file the system will
    not read is its one line, a missing object one naming it (or its missing bucket), a link
    out of the directory one naming the link (``location.model_file``)."""
    if location.is_remote(file):
        try:
            return location.read_bytes(file)
        except FileNotFoundError:
            raise WeightsError(f"{remote.missing_line(file, 'object')}; the model "
                               "directory is incomplete: copy it again") from None
    try:
        return Path(location.model_file(file, WeightsError)).read_bytes()
    except OSError as err:  # not the file's fault: the system's cause, said as such
        raise read_refused(err) from None


# ---- tensors ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a param comes from in Hugging Face's tensors: ``name``, transposed (a ``Linear``'s
    ``[out, in]`` weight), and for a fused tensor (GPT-2's and Phi-3's q/k/v, Phi-3's gate and
    up) the range of the param's last axis in it, of ``fused`` in all."""

    name: str
    transpose: bool = False
    span: tuple[int, int] | None = None
    fused: int = 0
    stack: tuple[str, ...] = ()  # the tensors of each expert, stacked on the param's first axis


def tensor_map(cfg: TransformerModel, model_type: str) -> dict[str, Source]:
    """trainrun's dotted param name -> its Hugging Face source, for every base param (LoRA
    adapters have none: ``peft.py``)."""
    names: dict[str, Source] = {}
    if model_type == "gpt2":
        d = cfg.d_model
        names["embed.embedding"] = Source(PREFIX + "wte.weight")
        names["positions"] = Source(PREFIX + "wpe.weight")
        names["ln_f.scale"], names["ln_f.bias"] = (Source(f"{PREFIX}ln_f.{p}")
                                                   for p in ("weight", "bias"))
        for i in range(cfg.layers):
            hf, ours = f"{PREFIX}h.{i}.", f"blocks.{i}."
            for theirs, norm in (("ln_1", "ln1"), ("ln_2", "ln2")):
                names[f"{ours}{norm}.scale"] = Source(f"{hf}{theirs}.weight")
                names[f"{ours}{norm}.bias"] = Source(f"{hf}{theirs}.bias")
            for j, proj in enumerate("qkv"):
                span = (j * d, (j + 1) * d)
                names[f"{ours}attn.{proj}.kernel"] = Source(f"{hf}attn.c_attn.weight", span=span,
                                                            fused=3 * d)
                names[f"{ours}attn.{proj}.bias"] = Source(f"{hf}attn.c_attn.bias", span=span,
                                                          fused=3 * d)
            for theirs, layer in (("attn.c_proj", "attn.o"), ("mlp.c_fc", "mlp.up"),
                                  ("mlp.c_proj", "mlp.down")):
                names[f"{ours}{layer}.kernel"] = Source(f"{hf}{theirs}.weight")
                names[f"{ours}{layer}.bias"] = Source(f"{hf}{theirs}.bias")
    else:
        names["embed.embedding"] = Source("model.embed_tokens.weight")
        names["ln_f.scale"] = Source("model.norm.weight")
        head_dim = cfg.attention_head_dim
        inner, kv_inner = cfg.heads * head_dim, cfg.kv_key_heads * head_dim
        qkv_spans = {"q": (0, inner), "k": (inner, inner + kv_inner),
                     "v": (inner + kv_inner, inner + 2 * kv_inner)}
        norms = (("ln1", "input_layernorm"), ("ln2", "pre_feedforward_layernorm"),
                 ("attn_out_norm", "post_attention_layernorm"),
                 ("mlp_out_norm", "post_feedforward_layernorm")) if cfg.post_norms else (
                 ("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))
        qkv_bias = cfg.qkv_bias or cfg.attention_bias
        mlp_bias = cfg.mlp_bias
        for i in range(cfg.layers):
            hf, ours = f"model.layers.{i}.", f"blocks.{i}."
            for norm, theirs in norms:
                names[f"{ours}{norm}.scale"] = Source(f"{hf}{theirs}.weight")
            if cfg.qk_norm:
                for proj in "qk":
                    names[f"{ours}attn.{proj}_norm.scale"] = Source(
                        f"{hf}self_attn.{proj}_norm.weight")
            for proj in "qkv":
                if model_type in FUSED:
                    names[f"{ours}attn.{proj}.kernel"] = Source(
                        f"{hf}self_attn.qkv_proj.weight", transpose=True, span=qkv_spans[proj],
                        fused=inner + 2 * kv_inner)
                else:
                    names[f"{ours}attn.{proj}.kernel"] = Source(
                        f"{hf}self_attn.{proj}_proj.weight", transpose=True)
                if qkv_bias:
                    names[f"{ours}attn.{proj}.bias"] = Source(f"{hf}self_attn.{proj}_proj.bias")
            names[f"{ours}attn.o.kernel"] = Source(f"{hf}self_attn.o_proj.weight", transpose=True)
            if cfg.attention_bias:
                names[f"{ours}attn.o.bias"] = Source(f"{hf}self_attn.o_proj.bias")
            if cfg.expert_layer(i):
                names.update(_expert_sources(cfg, model_type, hf, f"{ours}mlp."))
                continue
            for j, proj in enumerate(("gate", "up")):
                if model_type in FUSED:
                    names[f"{ours}mlp.{proj}.kernel"] = Source(
                        f"{hf}mlp.gate_up_proj.weight", transpose=True,
                        span=(j * cfg.hidden, (j + 1) * cfg.hidden), fused=2 * cfg.hidden)
                else:
                    names[f"{ours}mlp.{proj}.kernel"] = Source(f"{hf}mlp.{proj}_proj.weight",
                                                               transpose=True)
            names[f"{ours}mlp.down.kernel"] = Source(f"{hf}mlp.down_proj.weight", transpose=True)
            if mlp_bias:
                for proj in ("gate", "up", "down"):
                    names[f"{ours}mlp.{proj}.bias"] = Source(f"{hf}mlp.{proj}_proj.bias")
    if not cfg.tie_embeddings:
        names["head"] = Source(HEAD)
    return names


class Tensors:
    """The tensors of a model directory or a ``.safetensors`` file, read lazily: a tensor, or a
    slice of one, is read from its file when asked for, as float32 (bfloat16 and float16 files
    included), and the file is let go again, so its pages do not stay mapped into the process
    while the rest loads. Names of GPT-2 files saved without the ``transformer.`` prefix are
    given it. On object storage (``gs://``, ``s3://``) each file's header and each tensor (or
    the rows of it asked for) is a ranged read (``safetensors_ranges.py``): no file is copied
    to this machine.

    entries: for files on object storage, (file, name as stored) -> where its bytes lie."""

    def __init__(self, headers: dict[Location, dict[str, tuple[tuple[int, ...], str]]],
                 entries: dict[tuple[str, str], ranges.Entry] | None = None):
        self._entries = entries or {}
        self._where: dict[str, tuple[Location, str]] = {}  # name asked -> (file, name stored)
        self._header: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, dtype)
        stored = [name for header in headers.values() for name in header]
        gpt2_body = not any(n.startswith(PREFIX) for n in stored) and any(
            n.startswith("h.") or n == "wte.weight" for n in stored)
        for file, header in headers.items():
            for name, entry in header.items():
                asked = PREFIX + name if gpt2_body and name != HEAD else name
                self._where[asked] = (file, name)
                self._header[asked] = entry

    @classmethod
    def of(cls, path: Location) -> Tensors:
        """The tensors of a ``.safetensors`` file, or of a model directory (one file, or the
        shards its ``model.safetensors.index.json`` lists), local or on object storage."""
        entries: dict[tuple[str, str], ranges.Entry] = {}

        def header(file: Location) -> dict[str, tuple[tuple[int, ...], str]]:
            if not location.is_remote(file):
                return _header(file)
            found = _remote_header(file)
            entries.update({(str(file), name): entry for name, entry in found.items()})
            return {name: (entry.shape, entry.dtype) for name, entry in found.items()}

        if location.is_file(path):
            return cls({path: header(path)}, entries)
        index = path / INDEX
        if location.is_file(path / WEIGHTS):
            weights = location.model_file(path / WEIGHTS, WeightsError)
            return cls({weights: header(weights)}, entries)
        if not location.is_file(index):
            raise WeightsError(f"{path} has neither {WEIGHTS} nor {INDEX}; save the model with "
                               "save_pretrained (safetensors)")
        text = read_file(index)
        try:
            weight_map = json.loads(text)["weight_map"]
            files = {str(name): path / str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightsError(f"{index} is not a safetensors index (a JSON object with a "
                               "weight_map); save the model again") from None
        headers = {}
        for file in sorted(set(files.values()), key=str):
            if str(file.parent) != str(path) or not location.is_file(file):
                raise WeightsError(f"{index} lists {file.name}, which is not in {path}; the "
                                   "download is incomplete")
            found = header(location.model_file(file, WeightsError))
            listed = {n for n, f in files.items() if f == file}
            if listed - set(found):
                raise WeightsError(f"{file.name} lacks tensor {sorted(listed - set(found))[0]!r} "
                                   f"that {INDEX} places there; the download is incomplete")
            headers[file] = {n: e for n, e in found.items() if n in listed}
        return cls(headers, entries)

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header[name][0]

    def dtype(self, name: str) -> str:
        """safetensors' name of the tensor's dtype: F32, BF16, I64, BOOL, ..."""
        return self._header[name][1]

    def file(self, name: str) -> Location:
        return self._where[name][0]

    def check_floats(self, names: set[str] | list[str]) -> None:
        """Each of ``names`` holds floats: an integer or boolean tensor would be trained as
        floats, so it is refused on one line naming it, its dtype and its file."""
        for name in sorted(names):
            if self.dtype(name) not in FLOAT_DTYPES:
                raise WeightsError(f"tensor {name} in {self.file(name)} has dtype "
                                   f"{self.dtype(name)}; trainrun reads float weights "
                                   f"({', '.join(FLOAT_DTYPES)}): give the model's float "
                                   "weights")

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """``name``'s values (``index``: a slice of them) as float32."""
        from safetensors import safe_open

        file, stored = self._where[name]
        if location.is_remote(file):
            try:
                value = ranges.read_tensor(file, self._entries[str(file), stored], index)
            except ranges.Unreadable as err:
                raise WeightsError(f"cannot read tensor {name} from {file}: {err}") from None
            return np.asarray(value, np.float32)
        try:
            if self._header[name][1] == "BF16":  # numpy has no bfloat16: read through JAX
                import jax

                with (jax.default_device(jax.local_devices(backend="cpu")[0]),
                      safe_open(str(file), framework="flax") as f):
                    value = np.asarray(f.get_slice(stored)[index or ...])
            else:
                with safe_open(str(file), framework="numpy") as f:
                    value = f.get_slice(stored)[index or ...]
        except Exception as err:  # safetensors' own error types are not importable from numpy
            refuse_unreadable(file)  # safetensors says "No such file" for a denied read too
            raise WeightsError(f"cannot read tensor {name} from {file}: {err}"
                               .replace("\n", " ")) from None
        return np.asarray(value, np.float32)


def refuse_unreadable(file: Path) -> None:
    """Raise the system's own refusal to read ``file`` (permission denied: exit 1), if any;
    safetensors reports every failure to open a file as "No such file or directory"."""
    try:
        with open(file, "rb"):
            pass
    except OSError as err:
        raise read_refused(err) from None


def _remote_header(file: Location) -> dict[str, ranges.Entry]:
    """Each tensor's entry in a safetensors object, from its header (ranged reads)."""
    try:
        return ranges.read_header(file)
    except FileNotFoundError:
        raise WeightsError(f"{remote.missing_line(file, 'object')}; the model directory is "
                           "incomplete: copy it again") from None
    except ranges.Unreadable as err:
        raise WeightsError(f"cannot read {file}: {err}; is the file complete?") from None


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and dtype in a safetensors file, from its header."""
    from safetensors import safe_open

    refuse_unreadable(file)
    try:
        with safe_open(str(file), framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}  # noqa: SIM118  # safe_open is not a mapping
    except Exception as err:  # SafetensorError: truncated, not safetensors, unreadable
        raise WeightsError(f"cannot read {file}: {err}; is the file complete?"
                           .replace("\n", " ")) from None


def check_tensors(tensors: Tensors, wanted: dict[str, Source], shapes: dict[str, tuple[int, ...]],
                  where: str) -> None:
    """Every source tensor present, of floats and of the shape its params need, and none left
    over (a tied head's copy of the embedding excepted: ``separate_head`` tells a copy)."""
    needed: dict[str, tuple[int, ...]] = {}
    for param, source in wanted.items():
        shape = shapes[param]
        if source.stack:  # one tensor per expert, each the param's shape less its first axis
            for name in source.stack:
                needed[name] = shape[1:][::-1] if source.transpose else shape[1:]
            continue
        if source.span is not None:  # a fused tensor: params side by side on the last axis
            shape = (*shape[:-1], source.fused)
        full = shape[::-1] if source.transpose else shape
        needed[source.name] = full
    leftover = sorted(tensors.names - set(needed) - {HEAD}  # tied: a copy
                      - {n for n in tensors.names if n.endswith(".attn.bias")
                         or n.endswith(".attn.masked_bias")})  # GPT-2's causal-mask buffers
    if leftover:
        raise WeightsError(f"tensor {leftover[0]!r} in {where} has no place in the model "
                           f"({len(leftover)} such); does config.json match the weights?")
    for name, shape in needed.items():
        if name not in tensors.names:
            raise WeightsError(f"tensor {name} is missing from {where}")
        if tensors.shape(name) != shape:
            raise WeightsError(f"tensor {name} has shape {tensors.shape(name)} in {where}; the "
                               f"model needs {shape} (does config.json match the weights?)")
    tensors.check_floats(set(needed))


def separate_head(tensors: Tensors, model_type: str) -> bool:
    """Whether the weights hold an ``lm_head.weight`` that is not a copy of the embedding.
    ``transformers`` then loads it as a head of its own whatever ``tie_word_embeddings`` says
    (``PreTrainedModel.tie_weights`` ties only equal tensors), so trainrun unties it too. The
    two are compared a block of rows at a time, never whole in memory."""
    embedding = PREFIX + "wte.weight" if model_type == "gpt2" else "model.embed_tokens.weight"
    if HEAD not in tensors.names or embedding not in tensors.names:
        return False  # no head: tied; no embedding: check_tensors names it missing
    shape = tensors.shape(HEAD)
    if shape != tensors.shape(embedding):
        return True
    if not shape:
        return not np.array_equal(tensors.read(HEAD), tensors.read(embedding))
    rows = max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], rows):
        block = (slice(start, min(start + rows, shape[0])), *(slice(None),) * (len(shape) - 1))
        if not np.array_equal(tensors.read(HEAD, block), tensors.read(embedding, block)):
            return True
    return False


def read_param(tensors: Tensors, source: Source,
               index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The param ``source`` gives (``index``: the part of it in trainrun's layout), float32."""
    if source.stack:
        first, rest = (index[0], index[1:]) if index else (slice(None), None)
        names = source.stack[first]
        parts = [read_param(tensors, Source(name, source.transpose), rest or None)
                 for name in names]
        return np.stack(parts)
    if source.span is not None:  # a fused tensor: this param's part of its last axis
        lo, hi = source.span
        index = index or (slice(None),) * len(tensors.shape(source.name))
        start, stop, _ = index[-1].indices(hi - lo)
        index = (*index[:-1], slice(lo + start, lo + stop))
    if index is not None and source.transpose:
        index = index[::-1]
    value = tensors.read(source.name, index)
    return value.T if source.transpose else value


# ---- writing ---------------------------------------------------------------------------------


def hf_tensors(params: dict[str, np.ndarray], cfg: TransformerModel,
               model_type: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, float32 tensor)`` in Hugging Face's layout from trainrun's dotted params."""
    fused: dict[str, list[tuple[int, np.ndarray]]] = {}
    transposed: dict[str, bool] = {}
    for param, source in tensor_map(cfg, model_type).items():
        value = np.asarray(params[param], np.float32)
        for name, part in zip(source.stack, value, strict=False):
            yield name, np.ascontiguousarray(part.T if source.transpose else part)
        if source.stack:
            continue
        if source.span is not None:
            fused.setdefault(source.name, []).append((source.span[0], value))
            transposed[source.name] = source.transpose
            continue
        yield source.name, np.ascontiguousarray(value.T if source.transpose else value)
    for name, parts in fused.items():
        whole = np.concatenate([v for _, v in sorted(parts, key=lambda p: p[0])], axis=-1)
        yield name, np.ascontiguousarray(whole.T if transposed[name] else whole)


def write_weights(tensors: Iterator[tuple[str, np.ndarray]], path: Path, *,
                  dtype: str = "float32", shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Tensors as ``model.safetensors``, or as shards of at most ``shard_bytes`` with
    ``model.safetensors.index.json`` where they need more than one, one shard in memory at a
    time. ``dtype``: float32, bfloat16 or float16."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    shard: dict[str, np.ndarray] = {}
    written: list[tuple[Path, list[str]]] = []
    total = size = 0
    for name, value in tensors:
        nbytes = value.size * itemsize
        if shard and size + nbytes > shard_bytes:
            written.append((_write_shard(shard, path / f".shard-{len(written)}", dtype),
                            list(shard)))
            shard, size = {}, 0
        shard[name] = value
        size += nbytes
        total += nbytes
    written.append((_write_shard(shard, path / f".shard-{len(written)}", dtype), list(shard)))
    if len(written) == 1:
        return [written[0][0].rename(path / WEIGHTS)]
    files, weight_map = [], {}
    for i, (file, names) in enumerate(written):
        final = file.rename(path / f"model-{i + 1:05d}-of-{len(written):05d}.safetensors")
        files.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": dict(sorted(weight_map.items()))},
                                         indent=2) + "\n")
    return files


def write_model_dir(params: PyTree, cfg: TransformerModel, path: Path, *, model_type: str,
                    source: dict[str, Any] | None = None, dtype: str = "float32",
                    shard_bytes: int = 5 * 2**30) -> Path:
    """``config.json`` and the weights (sharded above ``shard_bytes``) of ``params`` (a nested
    dict, without adapters) in ``model_type``'s layout, which ``transformers`` loads with
    ``from_pretrained``. ``source``: the config.json the model came from (kept fields)."""
    hf = config_json(cfg, model_type, source)
    for key in [k for k in ("dtype", "torch_dtype") if k in hf] or ["dtype"]:
        hf[key] = dtype  # the weights' dtype, under the source's spelling (older: torch_dtype)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(hf_tensors(dotted(params), cfg, model_type), path, dtype=dtype,
                  shard_bytes=shard_bytes)
    (path / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    return path


def dotted(tree: PyTree, prefix: str = "") -> dict[str, np.ndarray]:
    """A nested dict of arrays as ``{"blocks.0.attn.q.kernel": array, ...}``."""
    if not isinstance(tree, dict):
        return {prefix: np.asarray(tree)}
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        out.update(dotted(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def model_type_of(cfg: TransformerModel) -> str:
    """The Hugging Face family a transformer's layout is (for a model that came from none);
    a layout that is no family's is refused in one line."""
    if cfg.positions == "learned" and cfg.norm == "layernorm" and cfg.mlp == "gelu":
        return "gpt2"
    if cfg.positions == "rope" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu":
        return "phi3" if cfg.fused_projections else "qwen2" if cfg.qkv_bias else "llama"
    raise WeightsError(f"the model's layout ({cfg.norm}, {cfg.mlp} MLP, {cfg.positions} "
                       "positions) is no Hugging Face family's: train with GPT-2's "
                       "(model.positions=learned, model.bias=true) or the Llama family's "
                       "(model.norm=rmsnorm, model.mlp=swiglu) to export")


def _write_shard(tensors: dict[str, np.ndarray], file: Path, dtype: str) -> Path:
    if dtype == "float32":
        from safetensors.numpy import save_file

        save_file(tensors, str(file), metadata={"format": "pt"})
        return file
    import jax
    import jax.numpy as jnp
    from safetensors.flax import save_file as save_arrays

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        save_arrays({n: jnp.asarray(v, dtype) for n, v in tensors.items()}, str(file),
                    metadata={"format": "pt"})
    return file


def parse_size(text: str) -> int:
    """A size as bytes: a number with an optional unit (KB, MB, GB, TB; KiB, MiB, ...)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match:
        raise WeightsError(f"shard size {text!r} is not a size; give e.g. 5GB or 500MB")
    number, unit = float(match.group(1)), match.group(2).rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = " KMGT".index(unit[:1] or " ")
    return max(1, math.floor(number * base ** power))
