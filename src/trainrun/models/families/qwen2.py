"""Qwen2 (``qwen2``): the Llama layout with biases on q, k and v, a tied head by default, and
sliding windows per layer (``layer_types``, or ``use_sliding_window`` from
``max_window_layers`` on). A model trained in the Llama layout with q/k/v biases exports as
qwen2."""

from __future__ import annotations

from typing import Any

from trainrun.config import TransformerModel
from trainrun.models.families.llama_layout import LlamaLayout, family, is_llama_layout


def windowed_layer_types(hf: dict[str, Any], layers: int) -> list[str] | None:
    """The layer types ``use_sliding_window`` and ``max_window_layers`` imply (Qwen2's and
    Qwen3's config.json before ``layer_types``): local from that layer on."""
    if not hf.get("use_sliding_window"):
        return None
    start = int(hf.get("max_window_layers", layers))
    return ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]


def _writes_fresh(cfg: TransformerModel) -> bool:
    return is_llama_layout(cfg) and not cfg.fused_projections and cfg.qkv_bias


FAMILY = family(
    LlamaLayout(model_type="qwen2", title="Qwen2", architecture="Qwen2ForCausalLM",
                qkv_bias=True, tie_default=True, sliding="layer_types",
                layer_types=windowed_layer_types),
    writes_fresh=_writes_fresh)
