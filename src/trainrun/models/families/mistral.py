"""Mistral (``mistral``): the Llama layout with a sliding window on every layer
(``sliding_window``; null: none)."""

from __future__ import annotations

from trainrun.models.families.llama_layout import LlamaLayout, family

FAMILY = family(LlamaLayout(model_type="mistral", title="Mistral",
                            architecture="MistralForCausalLM", sliding="every_layer"))
