"""The JSON files of Hugging Face directories, typed: the keys of ``config.json`` that trainrun
reads of every family (a family's own keys: its module under ``families/``) and those of
PEFT's ``adapter_config.json``. Each value is checked before it is used; a wrong type, a size
out of range or a regular expression that does not compile is one line naming the file, the
key, the value and what the key takes. Keys trainrun does not read pass unchecked
(``extra="allow"``), as ``transformers`` keeps them.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, Strict

from trainrun.errors import UserError

INT64_MAX = 2**63 - 1  # the largest dimension an array can have
# Strict: "64" or 64.0 for a size, or 1 for a flag, is a damaged file, not a value to convert.
Count = Annotated[int, Strict(), Field(gt=0, le=INT64_MAX)]
Index = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Strict(), Field(ge=-INT64_MAX, le=INT64_MAX)]
Positive = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]

COUNT = "a whole number from 1 to 2**63 - 1"
POSITIVE = "a finite number above 0"
FLAG = "true or false"


class HFConfigError(UserError):
    """A value of ``config.json`` or ``adapter_config.json`` that is not what its key takes."""


class _JsonFile(BaseModel):
    model_config = ConfigDict(extra="allow")  # keys trainrun does not read pass unchecked


class RopeParameters(_JsonFile):
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` (hub checkpoints)."""

    rope_type: Text | None = Field(default=None, description="a rotary scheme's name")
    type: Text | None = Field(default=None, description="a rotary scheme's name")
    rope_theta: Positive | None = Field(default=None, description=POSITIVE)
    factor: Positive | None = Field(default=None, description=POSITIVE)
    low_freq_factor: Positive | None = Field(default=None, description=POSITIVE)
    high_freq_factor: Positive | None = Field(default=None, description=POSITIVE)
    original_max_position_embeddings: Count | None = Field(default=None, description=COUNT)
    partial_rotary_factor: Positive | None = Field(default=None, description=POSITIVE)


class ModelConfig(_JsonFile):
    """The keys of a config.json that trainrun reads of every family."""

    model_type: Text = Field(description="a model type's name")
    vocab_size: Count | None = Field(default=None, description=COUNT)
    tie_word_embeddings: Flag | None = Field(default=None, description=FLAG)
    quantization_config: Any = None
    partial_rotary_factor: Positive | None = Field(default=None, description=POSITIVE)
    rope_parameters: RopeParameters | None = Field(
        default=None, description="an object of rotary settings (rope_type, rope_theta, ...)")


def _compiles(pattern: str, what: str) -> None:
    """``pattern`` compiles, or a ValueError naming ``what`` holds it."""
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{what} is not a regular expression ({err})") from None


class AdapterConfig(_JsonFile):
    """The keys of PEFT's ``adapter_config.json`` that trainrun reads."""

    peft_type: Text | None = Field(default=None, description="a PEFT method's name")
    base_model_name_or_path: Text | None = Field(default=None, description="a path or hub id")
    r: Count = Field(default=8, description=COUNT)
    lora_alpha: Number = Field(default=8, description="a finite number")
    use_rslora: Flag | None = Field(default=None, description=FLAG)
    bias: Text = Field(default="none", description="none, all or lora_only")
    init_lora_weights: Flag | Text | None = Field(default=None, description="true, false or a name")
    target_modules: list[Text] | Text | None = Field(
        default=None, description="a list of module names, or one regular expression")
    exclude_modules: list[Text] | Text | None = Field(
        default=None, description="a list of module names, or one regular expression")
    layers_to_transform: list[Index] | Index | None = Field(
        default=None, description="a layer index from 0, or a list of them")
    rank_pattern: dict[Text, Count] | None = Field(
        default=None, description=f"an object of regular expressions to ranks ({COUNT})")
    alpha_pattern: dict[Text, Number] | None = Field(
        default=None, description="an object of regular expressions to alphas (finite numbers)")

    @pydantic.model_validator(mode="after")
    def _patterns_compile(self) -> AdapterConfig:
        for name in ("target_modules", "exclude_modules"):
            pattern = getattr(self, name)
            if isinstance(pattern, str):  # PEFT matches it whole against module names
                _compiles(pattern, f"{name} {pattern!r}")
        for name in ("rank_pattern", "alpha_pattern"):
            for key in getattr(self, name) or {}:  # PEFT matches (.*\.)?(KEY)$ with each
                _compiles(key, f"{name} key {key!r}")
        return self


MODEL_FIX = "correct it, or save the model again with save_pretrained"
ADAPTER_FIX = "correct it, or save the adapter again with PEFT's save_pretrained"


def checked_model_config(hf: dict[str, Any], where: str,
                         schema: type[ModelConfig]) -> dict[str, Any]:
    """``hf`` (a ``config.json`` of a model_type trainrun reads, whose keys ``schema`` types)
    once every key trainrun reads holds what it takes; else ``HFConfigError`` on one line."""
    checked(schema, hf, where, MODEL_FIX)
    return hf


def checked_adapter_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """``config`` (an ``adapter_config.json``) once every key trainrun reads holds what it
    takes; else ``HFConfigError`` on one line."""
    checked(AdapterConfig, config, where, ADAPTER_FIX)
    return config


def checked(model: type[BaseModel], raw: dict[str, Any], where: str, fix: str) -> None:
    """Validate ``raw`` as ``model``; the first problem becomes one line naming ``where`` (the
    file), the key, the value and what the key takes, then ``fix``."""
    try:
        model.model_validate(raw)
    except pydantic.ValidationError as err:
        raise HFConfigError(describe(err, model, raw, where, fix)) from None


def describe(err: pydantic.ValidationError, model: type[BaseModel], raw: dict[str, Any],
             where: str, fix: str) -> str:
    """The one line for the first problem ``err`` found in ``raw``."""
    first = err.errors()[0]
    if first["type"] == "value_error":  # a check across keys, or a pattern: its own words
        return f"{where}: {first['msg'].removeprefix('Value error, ')}; {fix}"
    key, value = _located(raw, first["loc"])
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return (f"{where} has {key} {shown}, which is not {_description(model, first['loc'])}; "
            f"{fix}")


def _located(raw: Any, loc: tuple[int | str, ...]) -> tuple[str, Any]:
    """The key path (``rope_parameters.factor``, ``target_modules[1]``) and value a pydantic
    location points at in ``raw``; a union member's name in the location is passed over."""
    key, value = "", raw
    for part in loc:
        if isinstance(value, dict) and part in value:
            key, value = f"{key}.{part}" if key else str(part), value[part]
        elif isinstance(value, list) and isinstance(part, int) and part < len(value):
            key, value = f"{key}[{part}]", value[part]
    return key, value


def _description(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """What the deepest field of ``model`` on ``loc`` takes (its ``description``)."""
    described, current = "a valid value", model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue
        described = field.description or described
        nested = [t for t in _members(field.annotation)
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            break
        current = nested[0]
    return described


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)
