"""Gemma 2 (``gemma2``): Gemma 3's layout without its q/k norms, with soft-capped logits: 1 + w
norms before and after each sublayer, scaled embeddings, a GeGLU MLP (``hidden_activation``),
queries scaled by ``query_pre_attn_scalar``, a tied head by default, attention logits capped by
``attn_logit_softcapping`` before the mask and the output head's by
``final_logit_softcapping``, and every other layer local (a sliding window), the first
included, all with one rotary base."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field

from trainrun.models.families.family import WeightsError
from trainrun.models.families.llama_layout import LlamaConfig, LlamaLayout, family
from trainrun.models.hf_config import POSITIVE, Positive


class Gemma2Config(LlamaConfig):
    """The keys of a Gemma 2 config.json trainrun reads beside the Llama layout's."""

    attn_logit_softcapping: Positive | None = Field(default=None, description=POSITIVE)
    final_logit_softcapping: Positive | None = Field(default=None, description=POSITIVE)


def alternate_layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    """The layer types a config.json without the key implies (transformers' ``Gemma2Config``):
    even layers local, odd ones global."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]


def refuse(hf: dict[str, Any]) -> None:
    """What Gemma 2's config.json may ask that trainrun does not compute, in one line."""
    if hf.get("use_bidirectional_attention"):
        raise WeightsError("use_bidirectional_attention=true is not supported; trainrun's "
                           "attention is causal")


FAMILY = dataclasses.replace(family(LlamaLayout(
    model_type="gemma2", title="Gemma 2", architecture="Gemma2ForCausalLM",
    attention_bias=True, activation_key="hidden_activation",
    default_activation="gelu_pytorch_tanh", norm_plus_one=True, post_norms=True,
    softcaps=(50.0, 30.0), embed_scale=True, query_scale_key="query_pre_attn_scalar",
    tie_default=True, sliding="layer_types", layer_types=alternate_layer_types,
    global_window=4096, refuse=refuse, pad_default=0)), schema=Gemma2Config)
