"""Mixtral (``mixtral``): Mistral's layout with a mixture of experts in every layer
(``block_sparse_moe``, experts' ``w1``/``w3``/``w2``), top-k weights renormalised."""

from __future__ import annotations

from typing import Any

from trainrun.config import TransformerModel
from trainrun.models.families.experts_layout import ExpertLayout, expert_count, mixture_json
from trainrun.models.families.llama_layout import LlamaLayout, family


def experts(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The mixture's fields of a Mixtral config.json."""
    return {"experts": expert_count(hf),
            "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
            "expert_hidden": None, "router_renormalise": True, "dense_layers": (),
            "shared_expert_hidden": None,
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001))}


def experts_json(cfg: TransformerModel) -> dict[str, Any]:
    """The mixture's keys of a Mixtral config.json."""
    return {**mixture_json(cfg, "mixtral"), "num_local_experts": cfg.experts}


FAMILY = family(LlamaLayout(
    model_type="mixtral", title="Mixtral", architecture="MixtralForCausalLM",
    sliding="every_layer",
    experts=ExpertLayout(fields=experts, json=experts_json, module="block_sparse_moe",
                         parts={"gate": "w1", "up": "w3", "down": "w2"})))
