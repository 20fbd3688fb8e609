"""Qwen3-MoE (``qwen3_moe``): Qwen3's layout (q/k norms, optional attention biases) with a
mixture of experts every ``decoder_sparse_step`` layers but ``mlp_only_layers``, top-k weights
renormalised by default (``norm_topk_prob``)."""

from __future__ import annotations

from typing import Any

from trainrun.config import TransformerModel
from trainrun.models.families.experts_layout import (
    ExpertLayout,
    sparse_step_fields,
    sparse_step_json,
)
from trainrun.models.families.llama_layout import LlamaLayout, family


def experts(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The mixture's fields of a Qwen3-MoE config.json."""
    return sparse_step_fields(hf, layers, shared=False, renormalise=True)


def experts_json(cfg: TransformerModel) -> dict[str, Any]:
    """The mixture's keys of a Qwen3-MoE config.json."""
    return sparse_step_json(cfg, "qwen3_moe")


FAMILY = family(LlamaLayout(
    model_type="qwen3_moe", title="Qwen3-MoE", architecture="Qwen3MoeForCausalLM",
    attention_bias=True, qk_norm=True,
    experts=ExpertLayout(fields=experts, json=experts_json)))
