"""Qwen2-MoE (``qwen2_moe``): Qwen2's layout (q/k/v biases, ``qkv_bias``) with a mixture of
experts every ``decoder_sparse_step`` layers but ``mlp_only_layers``, and a gated shared expert
beside the routed ones."""

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
    """The mixture's fields of a Qwen2-MoE config.json, and its q/k/v biases."""
    return {**sparse_step_fields(hf, layers, shared=True, renormalise=False),
            "qkv_bias": bool(hf.get("qkv_bias", True))}


def experts_json(cfg: TransformerModel) -> dict[str, Any]:
    """The mixture's keys of a Qwen2-MoE config.json, and its q/k/v biases."""
    return {**sparse_step_json(cfg, "qwen2_moe"),
            "shared_expert_intermediate_size": cfg.shared_expert_hidden or 0,
            "qkv_bias": cfg.qkv_bias}


FAMILY = family(LlamaLayout(
    model_type="qwen2_moe", title="Qwen2-MoE", architecture="Qwen2MoeForCausalLM",
    qkv_bias=True, experts=ExpertLayout(fields=experts, json=experts_json)))
