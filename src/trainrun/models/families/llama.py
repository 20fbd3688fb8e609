"""Llama (``llama``): the Llama layout as it is, with optional biases on q/k/v and o
(``attention_bias``) and on the MLP (``mlp_bias``). A model trained in the Llama layout without
q/k/v biases or fused projections exports as llama."""

from __future__ import annotations

from trainrun.config import TransformerModel
from trainrun.models.families.llama_layout import (
    EMBEDDING,
    LlamaLayout,
    family,
    has_fused_names,
    is_llama_layout,
)


def _writes_fresh(cfg: TransformerModel) -> bool:
    return is_llama_layout(cfg) and not cfg.fused_projections and not cfg.qkv_bias


FAMILY = family(
    LlamaLayout(model_type="llama", title="Llama", architecture="LlamaForCausalLM",
                attention_bias=True, mlp_bias=True),
    writes_fresh=_writes_fresh,
    reads_bare=lambda names: EMBEDDING in names and not has_fused_names(names))
