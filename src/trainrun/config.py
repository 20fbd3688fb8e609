"""The run's configuration: a typed, frozen tree loaded from YAML plus ``key.path=value`` overrides.

Validation is pydantic's (extra keys forbidden, types checked); this module only turns its
errors into one-line messages that name the bad key and the fix.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from trainrun.errors import UserError


class ConfigError(UserError):
    """A configuration the user must fix; the CLI prints it on one line and exits 2."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- model -----------------------------------------------------------------------------------


class MLPModel(Section):
    """The reference chapter's MLP as plain functions: features -> hidden (ReLU) -> outputs."""

    kind: Literal["mlp"] = "mlp"
    features: int = Field(8, gt=0)
    hidden: list[int] = Field(default_factory=lambda: [32])
    outputs: int = Field(1, gt=0)
    init_scale: float = Field(0.1, gt=0)


class NNXMLPModel(Section):
    """An MLP as a Flax NNX module: flattened ``x`` -> hidden (GELU, dropout) -> outputs."""

    kind: Literal["nnx_mlp"] = "nnx_mlp"
    features: int = Field(8, gt=0)
    hidden: list[int] = Field(default_factory=lambda: [64])
    outputs: int = Field(1, gt=0)
    task: Literal["regression", "classification"] = "regression"
    dropout: float = Field(0.0, ge=0, lt=1)


class CNNModel(Section):
    """A small image classifier: 3x3 conv blocks (ReLU, 2x2 max-pool) -> dense -> classes."""

    kind: Literal["cnn"] = "cnn"
    image_size: int = Field(8, gt=0)
    in_channels: int = Field(1, gt=0)
    channels: list[int] = Field(default_factory=lambda: [32, 64])
    hidden: int = Field(128, gt=0)
    classes: int = Field(10, gt=1)
    dropout: float = Field(0.0, ge=0, lt=1)


class TransformerModel(Section):
    """A decoder-only transformer LM: pre-LayerNorm blocks, causal attention, GELU MLP,
    input and output embeddings tied."""

    kind: Literal["transformer"] = "transformer"
    vocab: int = Field(256, gt=1)
    d_model: int = Field(128, gt=0)
    layers: int = Field(4, gt=0)
    heads: int = Field(4, gt=0)
    mlp_ratio: int = Field(4, gt=0)
    seq_len: int = Field(128, gt=0)
    positions: Literal["rope", "learned"] = "rope"
    dropout: float = Field(0.0, ge=0, lt=1)
    init_std: float = Field(0.02, gt=0)


ModelConfig = Annotated[
    Union[MLPModel, NNXMLPModel, CNNModel, TransformerModel],  # noqa: UP007
    Field(discriminator="kind")]


# ---- data ------------------------------------------------------------------------------------


class RegressionData(Section):
    """The chapter's synthetic regression: x ~ N(0, 1) from jax.random.key(seed), y = sum(x)."""

    kind: Literal["regression"] = "regression"
    examples: int = Field(256, gt=0)
    features: int = Field(8, gt=0)
    seed: int = 1
    batch_size: int = Field(256, gt=0)
    shuffle: bool = False
    prefetch_threads: int = Field(0, ge=0)


DataConfig = Annotated[Union[RegressionData], Field(discriminator="kind")]  # noqa: UP007


# ---- optimizer -------------------------------------------------------------------------------


class OptimizerConfig(Section):
    name: Literal["adam", "adamw", "sgd", "lion"] = "adam"
    lr: float = Field(1e-3, gt=0)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = Field(0.0, ge=0)
    momentum: float = Field(0.0, ge=0)


# ---- the run ---------------------------------------------------------------------------------


class RunConfig(Section):
    name: str = "run"
    seed: int = 0
    steps: int = Field(200, gt=0)
    steps_per_call: int = Field(1, gt=0)
    log_every: int = Field(50, gt=0)
    model: ModelConfig = Field(default_factory=MLPModel)
    data: DataConfig = Field(default_factory=RegressionData)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def digest(self) -> str:
        """sha256 of the resolved config: names a trajectory in provenance and on resume."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---- loading ---------------------------------------------------------------------------------

CONFIG_PACKAGE = "trainrun.configs"


def builtin_config_names() -> list[str]:
    files = resources.files(CONFIG_PACKAGE)
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A path to a YAML file, or the name of a built-in config (``mlp``, ``lm``, ...)."""
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {name_or_path!r} not found; give an existing path or "
                              f"a built-in name ({', '.join(builtin_config_names())})")
        return path
    builtin = resources.files(CONFIG_PACKAGE) / f"{name_or_path}.yaml"
    if not builtin.is_file():
        names = builtin_config_names()
        close = difflib.get_close_matches(name_or_path, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"no config named {name_or_path!r}; {hint}built-in configs: "
                          f"{', '.join(names)} (or give a path to a .yaml file)")
    return Path(str(builtin))


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=0.1", "steps=50"]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key.path=value (e.g. optimizer.lr=0.01)")
        value = yaml.safe_load(raw) if raw != "" else ""
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a key under {part!r}, which is a value")
        node[parts[-1]] = value
    return tree


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(name_or_path: str = "mlp", overrides: list[str] | None = None) -> RunConfig:
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of keys to values")
    return config_from_dict(merge(raw, parse_overrides(overrides or [])))


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except pydantic.ValidationError as err:
        raise ConfigError(describe_validation_error(err, raw)) from None


# ---- error messages --------------------------------------------------------------------------


def _union_members(annotation: Any) -> dict[str, type[BaseModel]] | None:
    """For a discriminated union of sections, {kind: section class}; else None."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation)
                   if isinstance(a, type) and issubclass(a, BaseModel)]
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        members = [annotation]  # a union of one collapses to its member
    else:
        return None
    tagged = {m.model_fields["kind"].default: m for m in members if "kind" in m.model_fields}
    return tagged or None


def _walk(loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Follow an error location through the config classes.

    Returns the user-facing path (union tags dropped), the section class holding the last key,
    and that key's annotation (None for an unknown key).
    """
    cls: type[BaseModel] | None = RunConfig
    path: list[str] = []
    annotation: Any = None
    items = list(loc)
    while items:
        part = items.pop(0)
        if cls is None:
            path.append(str(part))
            continue
        field = cls.model_fields.get(str(part))
        path.append(str(part))
        if field is None:
            return path, cls, None
        annotation = field.annotation
        members = _union_members(annotation)
        if members is not None and items and items[0] in members:
            cls = members[items.pop(0)]
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            cls = annotation
        else:
            cls = None
    return path, cls, annotation


def _type_name(annotation: Any) -> str:
    if annotation is None:
        return "a value"
    if isinstance(annotation, type):
        return annotation.__name__
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    return str(annotation).replace("typing.", "")


def describe_validation_error(err: pydantic.ValidationError, raw: dict[str, Any]) -> str:
    """The first problem of a pydantic error, as one line that names the key and the fix."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    path, cls, annotation = _walk(loc)
    dotted = ".".join(path)
    kind = first["type"]
    if kind == "extra_forbidden" and cls is not None:
        valid = [name for name in cls.model_fields]
        close = difflib.get_close_matches(path[-1], valid, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        where = ".".join(path[:-1]) or "the top level"
        return (f"unknown config key {dotted!r}; {hint}valid keys in {where}: "
                f"{', '.join(valid)}")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        members = _union_members(annotation) or {}
        given = first.get("input")
        tag = given.get("kind") if isinstance(given, dict) else given
        return (f"config key {dotted}.kind: unknown kind {tag!r}; "
                f"expected one of {', '.join(members)}")
    given = first.get("input")
    expected = _type_name(annotation)
    return (f"config key {dotted!r} expects {expected}, got {given!r} "
            f"({type(given).__name__}): {first['msg']}")


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
