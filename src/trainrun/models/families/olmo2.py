"""OLMo 2 (``olmo2``): the Llama layout with its norms moved: no RMSNorm before attention and
the MLP, one on each sublayer's output before its residual add (``post_attention_layernorm``,
``post_feedforward_layernorm``), and RMSNorm on the whole q and k projections, all heads
together, before the split into heads; biases on q/k/v and o where ``attention_bias``; an
untied head by default."""

from __future__ import annotations

from trainrun.models.families.llama_layout import LlamaLayout, family

FAMILY = family(LlamaLayout(
    model_type="olmo2", title="OLMo 2", architecture="Olmo2ForCausalLM", attention_bias=True,
    qk_norm=True, qk_norm_over="projection", pre_norms=False, post_norms=True, pad_default=1))
