"""What a Hugging Face model family is to trainrun (``Family``): how its ``config.json`` reads
into a ``TransformerModel`` and is written back, where each param lies among its tensors, and
where PEFT's LoRA adapters sit in its layers. Each family's module under ``families/`` builds
one; ``families/__init__.py`` maps ``model_type`` to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from trainrun.config import TransformerModel
from trainrun.errors import UserError
from trainrun.models.hf_config import ModelConfig, checked_model_config

CONFIG = "config.json"
HEAD = "lm_head.weight"
SCORE_TENSOR = "score.weight"  # a ...ForSequenceClassification's score head, every family's


class WeightsError(UserError):
    """Weights that do not fit the model; the CLI prints it on one line and exits 2."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What a ``config.json`` says of the model: the transformer's fields it sets, with the
    config.json key each came from (for messages), and the longest context it was made for."""

    model_type: str
    fields: dict[str, Any]
    keys: dict[str, str]
    max_positions: int


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a param comes from in Hugging Face's tensors: ``name``, transposed (a ``Linear``'s
    ``[out, in]`` weight), and for a fused tensor (GPT-2's and Phi-3's q/k/v, Phi-3's gate and
    up) the range of the param's last axis in it, of ``fused`` in all."""

    name: str
    transpose: bool = False
    span: tuple[int, int] | None = None
    fused: int = 0
    stack: tuple[str, ...] = ()  # the tensors of each expert, stacked on the param's first axis


@dataclasses.dataclass(frozen=True)
class AdapterLayout:
    """Where PEFT's LoRA adapters sit in a family's decoder layers.

    layers: the layers' path (``model.layers``); modules: trainrun's target -> the module path
    inside a layer that carries it as one LoRA pair; dims: each module path's (d_in, d_out) in
    a model; fused: trainrun's fused adapter (``qkv``, ``gate_up``) -> the module carrying it;
    joined: a module holding q, k and v that carries trainrun's separate q/k/v adapters as one
    adapter of their summed rank (GPT-2's ``attn.c_attn``); experts: whether a mixture's experts
    and router take adapters through PEFT's ``target_parameters``."""

    layers: str
    modules: dict[str, str]
    dims: Callable[[TransformerModel], dict[str, tuple[int, int]]]
    fused: dict[str, str] = dataclasses.field(default_factory=dict)
    joined: str | None = None
    fan_in_fan_out: bool = False  # weights stored [in, out] (GPT-2's Conv1D)
    experts: bool = False


def padding_row(hf: dict[str, Any], default: int | None) -> int | None:
    """The embedding row transformers builds its family's ``nn.Embedding`` with as
    ``padding_idx`` (no gradient from its lookups): ``pad_token_id``, or the family's
    ``default`` where config.json lacks the key, a negative id counting from the end as torch
    takes it. A default outside the vocabulary (config.json names none) holds no row out; a
    ``pad_token_id`` outside it is refused, as torch refuses it."""
    vocab = int(hf["vocab_size"])
    pad = hf.get("pad_token_id", default)
    if pad is None or ("pad_token_id" not in hf and not 0 <= pad < vocab):
        return None
    if not -vocab <= pad < vocab:
        raise WeightsError(f"pad_token_id {pad} is not a token of the vocabulary (vocab_size "
                           f"{vocab}), and transformers cannot build its embedding; set it to "
                           "the pad token's id, or null")
    return pad % vocab


def never(_: Any) -> bool:
    """A predicate that holds for nothing: a family no fresh model or bare file is of."""
    return False


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face ``model_type`` trainrun reads and writes.

    schema: the config.json keys trainrun reads, typed (``hf_config``); fields: config.json ->
    the transformer's fields (refusing on one line what trainrun cannot compute), once
    ``checked_fields`` has checked what every family shares; config_json: a model's
    config.json before ``huggingface.kept_source`` keeps the source's own fields (a layout the
    family cannot say is refused); tensor_map: trainrun's dotted param name -> its tensor;
    embedding: the embedding's tensor name; writes_fresh: whether a model trained from no
    config.json is written as this family; reads_bare: whether a ``.safetensors`` file of these
    tensor names (no config.json) is read in this family's layout; classifier: the
    ``architectures`` entry of the family's ``...ForSequenceClassification`` (a reward model's
    export)."""

    model_type: str
    title: str  # the family's name in messages
    schema: type[ModelConfig]
    fields: Callable[[dict[str, Any]], Architecture]
    config_json: Callable[[TransformerModel, dict[str, Any] | None], dict[str, Any]]
    tensor_map: Callable[[TransformerModel], dict[str, Source]]
    embedding: str
    adapters: AdapterLayout
    classifier: str
    writes_fresh: Callable[[TransformerModel], bool] = never
    reads_bare: Callable[[set[str]], bool] = never

    def architecture(self, hf: dict[str, Any], where: str = CONFIG) -> Architecture:
        """The transformer ``hf`` (this family's config.json) describes; see ``checked_fields``."""
        return checked_fields(hf, where, self.schema, self.fields)


def checked_fields(hf: dict[str, Any], where: str, schema: type[ModelConfig],
                   fields: Callable[[dict[str, Any]], Architecture]) -> Architecture:
    """``fields(hf)`` once every key trainrun reads holds what it takes (``schema``) and what no
    family computes is refused; a value of the wrong type or out of range, or a missing key,
    is refused in one line naming it."""
    checked_model_config(hf, where, schema)
    if hf.get("quantization_config"):
        raise WeightsError(f"{where} describes quantized weights (quantization_config); "
                           "trainrun reads float weights: give the unquantized model")
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                   hf.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise WeightsError(f"{where} has partial_rotary_factor {partial}; trainrun rotates the "
                           "whole head dimension")
    try:
        return fields(hf)
    except KeyError as err:
        raise WeightsError(f"{where} lacks {err.args[0]!r}, which a {hf['model_type']} "
                           "config.json has; is it complete?") from None
    except (TypeError, ValueError) as err:
        raise WeightsError(f"{where} has a value of the wrong type ({err})") from None
