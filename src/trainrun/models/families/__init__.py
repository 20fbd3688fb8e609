"""The Hugging Face model families trainrun reads and writes, one module each, by
``model_type``: ``FAMILIES`` maps each to its ``Family`` (``family.py``), in the order messages
list them; ``MODEL_TYPES`` are its keys. A family of the Llama layout is data over
``llama_layout.py`` (a mixture's experts over ``experts_layout.py``)."""

from __future__ import annotations

from trainrun.models.families import (
    gemma,
    gemma2,
    gpt2,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from trainrun.models.families.family import Family

FAMILIES: dict[str, Family] = {module.FAMILY.model_type: module.FAMILY for module in (
    gpt2, llama, qwen2, mistral, qwen3, gemma2, gemma, phi3, olmo2, mixtral, qwen2_moe,
    qwen3_moe)}
MODEL_TYPES = tuple(FAMILIES)
