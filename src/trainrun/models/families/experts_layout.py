"""A mixture of experts in the Llama layout: the router and each expert's gate, up and down
projections of a layer, one tensor per expert, stacked on the param's first axis; what a
family's config.json says of its mixture (``ExpertLayout``), and the checks every family's
mixture shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from trainrun.config import TransformerModel
from trainrun.models.families.family import Source, WeightsError

# the mixture's fields -> the config.json key each comes from (for messages)
EXPERT_KEYS = {"experts": "num_experts", "experts_per_token": "num_experts_per_tok",
               "expert_hidden": "moe_intermediate_size",
               "shared_expert_hidden": "shared_expert_intermediate_size",
               "router_aux_loss": "router_aux_loss_coef", "dense_layers": "mlp_only_layers"}
PROJECTIONS = {p: f"{p}_proj" for p in ("gate", "up", "down")}


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """A family's mixture of experts: ``fields``: config.json (and the layer count) -> the
    transformer's mixture fields; ``json``: the model -> the mixture's config.json keys;
    ``module``: the mixture's module in a layer; ``parts``: trainrun's projection -> the
    expert's module."""

    fields: Callable[[dict[str, Any], int], dict[str, Any]]
    json: Callable[[TransformerModel], dict[str, Any]]
    module: str = "mlp"
    parts: dict[str, str] = dataclasses.field(default_factory=lambda: dict(PROJECTIONS))
    keys: dict[str, str] = dataclasses.field(default_factory=lambda: dict(EXPERT_KEYS))


def expert_count(hf: dict[str, Any]) -> int:
    """The number of experts a config.json names; a router with noise, or fewer than two
    experts, is refused in one line."""
    if float(hf.get("router_jitter_noise") or 0.0):
        raise WeightsError(f"router_jitter_noise {hf['router_jitter_noise']} is not supported; "
                           "trainrun's router adds no noise: set it to 0")
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts < 2:
        raise WeightsError(f"num_experts {experts} names no mixture; a dense model has its "
                           "own model_type")
    return experts


def sparse_step_fields(hf: dict[str, Any], layers: int, *, shared: bool,
                       renormalise: bool) -> dict[str, Any]:
    """The mixture's fields where an expert layer comes every ``decoder_sparse_step`` layers
    but those of ``mlp_only_layers`` (``shared``: a gated shared expert beside them;
    ``renormalise``: ``norm_topk_prob`` where absent)."""
    experts = expert_count(hf)
    step = int(hf.get("decoder_sparse_step", 1))
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    width = hf.get("shared_expert_intermediate_size") if shared else None
    return {"experts": experts, "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
            "expert_hidden": int(hf["moe_intermediate_size"]),
            "router_renormalise": bool(hf.get("norm_topk_prob", renormalise)),
            "dense_layers": dense, "shared_expert_hidden": int(width) if width else None,
            "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.001))}


def mixture_json(cfg: TransformerModel, model_type: str) -> dict[str, Any]:
    """The config.json keys every family's mixture writes; a model without experts is
    refused."""
    if cfg.experts is None:
        raise WeightsError(f"the model has no experts, which {model_type} has: export it as "
                           "the dense family it was trained from")
    return {"num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss, "output_router_logits": False}


def sparse_step_json(cfg: TransformerModel, model_type: str) -> dict[str, Any]:
    """The mixture's config.json keys where ``sparse_step_fields`` reads them."""
    out = mixture_json(cfg, model_type)
    out.update(num_experts=cfg.experts, moe_intermediate_size=cfg.expert_width,
               norm_topk_prob=cfg.router_renormalise, decoder_sparse_step=1,
               mlp_only_layers=list(cfg.dense_layers))
    return out


def expert_sources(cfg: TransformerModel, layout: ExpertLayout | None, hf: str, ours: str
                   ) -> dict[str, Source]:
    """The sources of one expert layer's params (``hf``: the layer's prefix); without a
    family's ``layout``, the mixture sits in ``mlp`` with projections named as a dense MLP's."""
    assert cfg.experts is not None
    module, parts = (layout.module, layout.parts) if layout is not None else ("mlp", PROJECTIONS)
    moe = f"{hf}{module}."
    names = {f"{ours}router": Source(f"{moe}gate.weight", transpose=True)}
    for ours_name, theirs in parts.items():
        stack = tuple(f"{moe}experts.{e}.{theirs}.weight" for e in range(cfg.experts))
        names[f"{ours}{ours_name}"] = Source(stack[0], transpose=True, stack=stack)
    if cfg.shared_expert_hidden is not None:
        names[f"{ours}shared_gate"] = Source(f"{moe}shared_expert_gate.weight", transpose=True)
        for p in ("gate", "up", "down"):
            key = "shared_gate_proj" if p == "gate" else f"shared_{p}"
            names[f"{ours}{key}"] = Source(f"{moe}shared_expert.{p}_proj.weight", transpose=True)
    return names
