"""Gemma 3's text model (``gemma3_text``): the Llama layout with 1 + w norms, norms after each
sublayer as well as before, scaled embeddings, q/k norms, a GeGLU MLP
(``hidden_activation``), queries scaled by ``query_pre_attn_scalar``, a tied head by default,
local layers (a sliding window, a rotary base of their own) among global ones, and output
logits soft-capped where ``final_logit_softcapping`` is set (null by default)."""

from __future__ import annotations

from typing import Any

from trainrun.models.families.family import WeightsError
from trainrun.models.families.llama_layout import LlamaLayout, family


def pattern_layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    """The layer types an older config.json implies: every ``sliding_window_pattern``-th
    layer global, the others local."""
    pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


def refuse(hf: dict[str, Any]) -> None:
    """What Gemma 3's config.json may ask that trainrun does not compute, in one line."""
    if hf.get("attn_logit_softcapping") is not None:
        # transformers' Gemma 3 soft-caps attention under eager attention only, not its sdpa
        raise WeightsError(f"attn_logit_softcapping={hf['attn_logit_softcapping']} is not "
                           "supported for gemma3_text: transformers applies it only under eager "
                           "attention, so the model has no one answer; set it to null")
    if hf.get("use_bidirectional_attention"):
        raise WeightsError("use_bidirectional_attention=true is not supported; trainrun's "
                           "attention is causal")


FAMILY = family(LlamaLayout(
    model_type="gemma3_text", title="Gemma 3", architecture="Gemma3ForCausalLM",
    classifier="Gemma3TextForSequenceClassification",
    attention_bias=True, qk_norm=True, activation_key="hidden_activation",
    default_activation="gelu_pytorch_tanh", norm_plus_one=True, post_norms=True,
    softcaps=(None, None), embed_scale=True, query_scale_key="query_pre_attn_scalar",
    rope_per_layer_type=True,
    tie_default=True, sliding="layer_types", layer_types=pattern_layer_types,
    global_window=4096, refuse=refuse, pad_default=0))
