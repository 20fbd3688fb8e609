"""GPT-2 (``gpt2``): learned positions, LayerNorm, a tanh-GELU MLP, biases everywhere, and
``Conv1D`` layers whose ``[in, out]`` weights are Flax's kernels as they are. Its names sit
under ``transformer.``; ``attn.c_attn`` holds q, k and v side by side on its last axis."""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import Field

from trainrun.config import TransformerModel
from trainrun.models.families.family import (
    HEAD,
    AdapterLayout,
    Architecture,
    Family,
    Source,
    WeightsError,
)
from trainrun.models.hf_config import (
    COUNT,
    FLAG,
    POSITIVE,
    Count,
    Flag,
    ModelConfig,
    Positive,
    Text,
)

PREFIX = "transformer."  # GPT2LMHeadModel's body; a bare GPT2Model's names lack it
C_ATTN = "attn.c_attn"
# trainrun target -> module; c_proj names two layers, so PEFT's entries keep the parent's name
ADAPTER_MODULES = {"o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}


class GPT2Config(ModelConfig):
    """The keys of a ``gpt2`` config.json that trainrun reads."""

    n_embd: Count | None = Field(default=None, description=COUNT)
    n_layer: Count | None = Field(default=None, description=COUNT)
    n_head: Count | None = Field(default=None, description=COUNT)
    n_inner: Count | None = Field(default=None, description=COUNT)
    n_positions: Count | None = Field(default=None, description=COUNT)
    layer_norm_epsilon: Positive | None = Field(default=None, description=POSITIVE)
    activation_function: Text | None = Field(default=None, description="an activation's name")
    scale_attn_weights: Flag | None = Field(default=None, description=FLAG)
    scale_attn_by_inverse_layer_idx: Flag | None = Field(default=None, description=FLAG)
    reorder_and_upcast_attn: Flag | None = Field(default=None, description=FLAG)

    @pydantic.model_validator(mode="after")
    def _heads_divide(self) -> GPT2Config:
        if self.n_embd is not None and self.n_head is not None and self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}, "
                             "which GPT-2's attention needs")
        return self


def fields(hf: dict[str, Any]) -> Architecture:
    """The transformer a gpt2 config.json describes."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        raise WeightsError(f"activation_function {activation!r} is not GPT-2's tanh GELU "
                           "(gelu_new), the one trainrun's transformer has")
    if not hf.get("scale_attn_weights", True):
        raise WeightsError("scale_attn_weights=false (attention logits not divided by "
                           "sqrt(head_dim)) is not supported; trainrun's attention scales them")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise WeightsError(f"{key}=true is not supported; trainrun's attention has neither")
    d = int(hf["n_embd"])
    keys = {"vocab": "vocab_size", "d_model": "n_embd", "layers": "n_layer", "heads": "n_head",
            "mlp_hidden": "n_inner", "seq_len": "n_positions",
            "norm_eps": "layer_norm_epsilon", "tie_embeddings": "tie_word_embeddings"}
    values = {"vocab": int(hf["vocab_size"]), "d_model": d, "layers": int(hf["n_layer"]),
              "heads": int(hf["n_head"]), "kv_heads": None, "head_dim": None,
              "mlp": "gelu", "mlp_hidden": int(hf.get("n_inner") or 4 * d),
              "norm": "layernorm", "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
              "seq_len": int(hf["n_positions"]), "positions": "learned", "bias": True,
              "qkv_bias": False, "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
              "rope_scaling": None, "pad_id": None}  # GPT-2's embedding has no padding_idx
    return Architecture("gpt2", values, keys, int(hf["n_positions"]))


def is_gpt2_layout(cfg: TransformerModel) -> bool:
    """Whether ``cfg`` is GPT-2's layout: learned positions, LayerNorm, a GELU MLP."""
    return cfg.positions == "learned" and cfg.norm == "layernorm" and cfg.mlp == "gelu"


def config_json(cfg: TransformerModel, source: dict[str, Any] | None) -> dict[str, Any]:
    """A gpt2 config.json for ``cfg`` over ``source``'s fields; another layout is refused."""
    if (cfg.positions != "learned" or not cfg.bias or cfg.norm != "layernorm"
            or cfg.mlp != "gelu" or cfg.kv_heads not in (None, cfg.heads)
            or cfg.head_dim not in (None, cfg.d_model // cfg.heads)):
        raise WeightsError("only a transformer with GPT-2's layout exports as gpt2 "
                           "(positions=learned, bias=true, layernorm, gelu MLP, one key/value "
                           "head per head)")
    out = {**(source or {}), "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
           "activation_function": "gelu_new", "vocab_size": cfg.vocab,
           "n_embd": cfg.d_model, "n_layer": cfg.layers, "n_head": cfg.heads,
           "n_inner": cfg.hidden, "n_positions": cfg.seq_len,
           "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
           "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True}
    out.setdefault("bos_token_id", None)
    out.setdefault("eos_token_id", None)
    return out


def tensor_map(cfg: TransformerModel) -> dict[str, Source]:
    """trainrun's dotted param name -> its GPT-2 tensor."""
    d = cfg.d_model
    names = {"embed.embedding": Source(PREFIX + "wte.weight"),
             "positions": Source(PREFIX + "wpe.weight")}
    names["ln_f.scale"], names["ln_f.bias"] = (Source(f"{PREFIX}ln_f.{p}")
                                               for p in ("weight", "bias"))
    for i in range(cfg.layers):
        hf, ours = f"{PREFIX}h.{i}.", f"blocks.{i}."
        for theirs, norm in (("ln_1", "ln1"), ("ln_2", "ln2")):
            names[f"{ours}{norm}.scale"] = Source(f"{hf}{theirs}.weight")
            names[f"{ours}{norm}.bias"] = Source(f"{hf}{theirs}.bias")
        for j, proj in enumerate("qkv"):
            span = (j * d, (j + 1) * d)
            names[f"{ours}attn.{proj}.kernel"] = Source(f"{hf}{C_ATTN}.weight", span=span,
                                                        fused=3 * d)
            names[f"{ours}attn.{proj}.bias"] = Source(f"{hf}{C_ATTN}.bias", span=span,
                                                      fused=3 * d)
        for theirs, layer in (("attn.c_proj", "attn.o"), ("mlp.c_fc", "mlp.up"),
                              ("mlp.c_proj", "mlp.down")):
            names[f"{ours}{layer}.kernel"] = Source(f"{hf}{theirs}.weight")
            names[f"{ours}{layer}.bias"] = Source(f"{hf}{theirs}.bias")
    if not cfg.tie_embeddings:
        names["head"] = Source(HEAD)
    return names


def adapter_dims(cfg: TransformerModel) -> dict[str, tuple[int, int]]:
    """Each adapted module's (d_in, d_out)."""
    d, hidden = cfg.d_model, cfg.hidden
    return {C_ATTN: (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, hidden),
            "mlp.c_proj": (hidden, d)}


FAMILY = Family(
    model_type="gpt2", title="GPT-2", schema=GPT2Config, fields=fields, config_json=config_json,
    tensor_map=tensor_map, embedding=PREFIX + "wte.weight",
    adapters=AdapterLayout(layers="transformer.h", modules=ADAPTER_MODULES, dims=adapter_dims,
                           joined=C_ATTN, fan_in_fan_out=True),
    classifier="GPT2ForSequenceClassification", writes_fresh=is_gpt2_layout,
    reads_bare=lambda names: any(n.startswith(PREFIX) for n in names))
