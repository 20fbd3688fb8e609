"""Qwen3 (``qwen3``): the Llama layout with RMSNorm on each head's queries and keys, optional
biases on q/k/v and o, and Qwen2's sliding windows per layer."""

from __future__ import annotations

from trainrun.models.families.llama_layout import LlamaLayout, family
from trainrun.models.families.qwen2 import windowed_layer_types

FAMILY = family(LlamaLayout(model_type="qwen3", title="Qwen3", architecture="Qwen3ForCausalLM",
                            attention_bias=True, qk_norm=True, sliding="layer_types",
                            layer_types=windowed_layer_types))
