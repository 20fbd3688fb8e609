"""Phi-3 (``phi3``): the Llama layout with q, k and v fused into one ``qkv_proj`` and gate and
up into one ``gate_up_proj`` per layer (each takes one LoRA adapter over its fused output), and
a sliding window on every layer. A model trained with fused projections exports as phi3."""

from __future__ import annotations

from trainrun.config import TransformerModel
from trainrun.models.families.llama_layout import (
    LlamaLayout,
    family,
    has_fused_names,
    is_llama_layout,
)


def _writes_fresh(cfg: TransformerModel) -> bool:
    return is_llama_layout(cfg) and cfg.fused_projections


FAMILY = family(LlamaLayout(model_type="phi3", title="Phi-3", architecture="Phi3ForCausalLM",
                            sliding="every_layer", fused=True, pad_default=32000),
                writes_fresh=_writes_fresh, reads_bare=has_fused_names)
