"""Where a config's values come from: a built-in name or a YAML file, the ``base:`` files it
extends, and ``key.path=value`` overrides, merged in that order over the defaults.

Each source is kept as a ``Layer`` so that ``trainrun config show`` can say which one set each
value; ``load_config`` merges the layers and validates the result."""

from __future__ import annotations

import difflib
import errno
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol, Self

import yaml

from trainrun.config import renamed
from trainrun.config.run import (
    ConfigError,
    RunConfig,
    config_from_dict,
    followed_keys,
    model_source,
    source_keys,
)
from trainrun.errors import path_refused

CONFIG_PACKAGE = "trainrun.configs"


@dataclass(frozen=True)
class Layer:
    """One source of values: ``origin`` says where they came from, ``tree`` holds them."""

    origin: str  # "file: <path or built-in name>", "base: <path or name>" or "override"
    tree: dict[str, Any]


def builtin_config_names() -> list[str]:
    files = resources.files(CONFIG_PACKAGE)
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def _builtin_path(name: str) -> Path | None:
    """The built-in config ``name`` names, if ``name`` is a bare name (not a path) and one."""
    if not name or "/" in name or os.sep in name or Path(name).suffix in {".yaml", ".yml"}:
        return None
    builtin = resources.files(CONFIG_PACKAGE) / f"{name}.yaml"
    return Path(str(builtin)) if builtin.is_file() else None


def resolve_config_path(name_or_path: str, relative_to: Path | None = None) -> Path:
    """A built-in config's name (``mlp``, ``digits``, ...) or a path to a YAML file.

    A bare name that is a built-in means the built-in, even where the working directory holds a
    file or folder of that name (``./digits`` means the local one). A relative path is taken
    from ``relative_to`` (the folder of the file whose ``base:`` names it), else from the
    working directory."""
    builtin = _builtin_path(name_or_path)
    if builtin is not None:
        return builtin
    names = ", ".join(builtin_config_names())
    path = Path(name_or_path) if relative_to is None else relative_to / name_or_path
    try:
        path.stat()
    except OSError as err:  # a path no file system holds (too long, a loop) is the input's
        line, code = path_refused(err)
        if code == 2 and err.errno != errno.ENOENT:
            raise ConfigError(f"config {line}") from None
    if path.is_dir():
        raise ConfigError(f"config {name_or_path!r} is a folder, not a YAML file; give the path "
                          f"of a .yaml file or a built-in name ({names})")
    if path.is_file():
        return path
    if "/" in name_or_path or os.sep in name_or_path or path.suffix in {".yaml", ".yml"}:
        where = f" (looked for {os.path.normpath(path)})" if relative_to is not None else ""
        raise ConfigError(f"config file {name_or_path!r} not found{where}; give an existing "
                          f"path or a built-in name ({names})")
    close = difflib.get_close_matches(name_or_path, builtin_config_names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"no config named {name_or_path!r}; {hint}built-in configs: {names} "
                      "(or give a path to a .yaml file)")


def _read_yaml(path: Path | SavedFile, label: str) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"config {label} is not UTF-8 text (byte {err.object[err.start]:#04x} "
                          f"at offset {err.start}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {label} is not valid YAML: {err}".replace("\n", " ")) from None
    if raw is None:  # an empty file would silently train the defaults
        raise ConfigError(f"config {label} is empty; give it at least one key (e.g. base: mlp "
                          "to start from a built-in), or pass the built-in's name instead")
    if not isinstance(raw, dict):
        raise ConfigError(f"config {label} must be a mapping of keys to values")
    return raw


def file_layers(name_or_path: str) -> list[Layer]:
    """The config file ``name_or_path`` and the chain of ``base:`` files below it, base first."""
    layers: list[Layer] = []
    seen: list[tuple[Path, str]] = []  # (resolved path, label) from the top file down
    spec, relative_to, kind = name_or_path, None, "file"
    while True:
        try:
            path = resolve_config_path(spec, relative_to)
        except ConfigError as err:
            if kind == "file":
                raise
            raise ConfigError(f"config {seen[-1][1]}: base {spec!r}: {err}") from None
        builtin = _builtin_path(spec) is not None
        label = spec if builtin else os.path.normpath(path)
        key = path.resolve()
        if any(key == p for p, _ in seen):
            start = next(i for i, (p, _) in enumerate(seen) if p == key)
            cycle = " -> ".join([*(lbl for _, lbl in seen[start:]), label])
            raise ConfigError(f"config base cycle: {cycle}; remove the base: key that closes it")
        seen.append((key, label))
        tree = _read_yaml(path, label)
        base = tree.pop("base", None)
        tree = _renamed(tree, label)
        layers.append(Layer(f"{kind}: {label}{' (built-in)' if builtin else ''}", tree))
        if base is None:
            return layers[::-1]
        if not isinstance(base, str) or not base:
            raise ConfigError(f"config {label}: base must be a built-in name or a path to a "
                              f"YAML file, got {base!r}")
        spec, relative_to, kind = base, path.parent, "base"


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["optimizer.lr=0.1", "steps=50"]`` -> nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key.path=value (e.g. optimizer.lr=0.01)")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: {raw!r} is not a valid YAML value; quote "
                              "it or close its brackets (e.g. model.hidden=[64,64])") from None
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a key under {part!r}, which is a value")
        node[parts[-1]] = value
    return _renamed(tree, "the overrides")


def _renamed(tree: dict[str, Any], source: str | None) -> dict[str, Any]:
    """A layer's keys under their new names, before it merges: an old name over a base that
    gives the new one replaces it, as any override does."""
    try:
        return renamed.upgrade(tree, source)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _merges(old: Any, new: Any) -> bool:
    """Whether ``new`` merges into ``old`` key by key rather than replacing it: both mappings,
    and not two kinds of a section (another kind has other keys: ``data.kind=tokens`` over
    text data would keep ``paths``, which token data refuses)."""
    return (isinstance(old, dict) and isinstance(new, dict)
            and ("kind" not in old or "kind" not in new or old["kind"] == new["kind"]))


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` over ``base``: mappings merge key by key, except a section whose ``kind``
    changes, which is replaced; anything else (lists too) replaces; ``null`` unsets a key (it
    takes its default, or follows the key it follows). Keys of ``base`` that ``update``
    displaces (``displaced``) are dropped first."""
    out = dict(base)
    for path in displaced(base, update):
        out = _without(out, path)
    return _merged(out, update)


def _merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if value is None:
            out.pop(key, None)
        elif _merges(out.get(key), value):
            out[key] = _merged(out[key], value)
        else:
            out[key] = _merged({}, value) if isinstance(value, dict) else value
    return out


def _without(tree: dict[str, Any], path: KeyPath) -> dict[str, Any]:
    """``tree`` less the key at ``path`` (copied where it changes)."""
    head, *rest = path
    if head not in tree:
        return tree
    if not rest:
        return {key: value for key, value in tree.items() if key != head}
    inner = tree[head]
    return {**tree, head: _without(inner, tuple(rest))} if isinstance(inner, dict) else tree


KeyPath = tuple[str, ...]
DATA_SOURCES = ("paths", "mix", "synthetic")  # records' sources: one is given


def displaced(base: dict[str, Any], update: dict[str, Any]) -> list[KeyPath]:
    """The keys of ``base`` that ``update`` (a later layer) gives another way, so that the
    later layer's choice stands where both would otherwise be refused together: a record
    source (``data.paths``, ``data.mix``, ``data.synthetic``) displaces the other two, and a
    model to start from (``init.from``: a run, a Hugging Face or adapter directory, not a
    bare ``.safetensors`` file, which names no architecture) displaces the transformer's
    architecture, tokenizer and chat template, which it gives."""
    out: list[KeyPath] = []
    data, new_data = base.get("data"), update.get("data")
    if isinstance(new_data, dict) and _merges(data, new_data):
        given = [key for key in DATA_SOURCES if new_data.get(key) is not None]
        out += [("data", key) for key in DATA_SOURCES if given and key not in given]
    new_model = update.get("model")
    if model_source(update) and (new_model is None or _merges(base.get("model"), new_model)):
        out += source_keys({**base, "init": update["init"]})
    return out


def config_layers(name_or_path: str = "mlp", overrides: list[str] | None = None) -> list[Layer]:
    """Every source of a config's values, lowest first: the bases, the file, the overrides."""
    layers = file_layers(name_or_path)
    if overrides:
        layers.append(Layer("override", parse_overrides(overrides)))
    return layers


class SavedFile(Protocol):
    """A run's saved config file as the storage layer hands it (a local path or an object)."""

    @property
    def parent(self) -> Self: ...

    def read_text(self, encoding: str | None = None) -> str: ...


def saved_layers(path: Path | SavedFile, overrides: list[str] | None = None) -> list[Layer]:
    """A run's saved ``config.yaml`` (every value resolved when it was written) and overrides
    over it: the config that resumes or extends that run as it was. Its ``distributed``
    section is left out: it says how the job that wrote it joined its processes (``launch``
    gives each its id and coordinator), not what the run computes, and a resume on one
    process would wait for the others."""
    remote = "://" in str(path)  # gs:// or s3://: a location, read as its own path type reads
    label = str(path) if remote else os.path.normpath(str(path))
    tree = _renamed(_read_yaml(path, label), None)  # trainrun wrote it: no warning
    tree.pop("distributed", None)
    layers = [Layer(f"run: {str(path.parent) if remote else os.path.normpath(str(path.parent))}",
                    tree)]
    if overrides:
        layers.append(Layer("override", parse_overrides(overrides)))
    return layers


def config_from_layers(layers: list[Layer]) -> RunConfig:
    """The validated config the layers give, each over the ones before it."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = merge(merged, layer.tree)
    return config_from_dict(merged)


def load_config(name_or_path: str = "mlp", overrides: list[str] | None = None) -> RunConfig:
    """The validated config of a built-in name or YAML file, its bases, and overrides.

    Args:
        name_or_path: a built-in config's name (``mlp``, ``digits``, ``lm``) or a path to a
            YAML file, which may extend another through ``base:``.
        overrides: ``key.path=value`` strings applied last; values are parsed as YAML.

    Returns:
        The ``RunConfig``: defaults, then the bases, the file and the overrides, in that order.

    Raises:
        ConfigError: one line naming the bad file, key or value and how to fix it.

    Example:
        ``trainrun.load_config("mlp", ["steps=300", "optimizer.lr=0.003"])``
    """
    return config_from_layers(config_layers(name_or_path, overrides))


# ---- config show -----------------------------------------------------------------------------


def _leaves(tree: dict[str, Any], path: KeyPath = ()) -> list[KeyPath]:
    out: list[KeyPath] = []
    for key, value in tree.items():
        here = (*path, key)
        if value is not None:  # null unsets
            out += _leaves(value, here) if isinstance(value, dict) and value else [here]
    return out


def _track(old: Any, new: Any, path: KeyPath, origin: str, origins: dict[KeyPath, str]) -> None:
    """Record in ``origins`` the values ``new`` sets over ``old``, as ``merge`` applies it: a
    replaced value or section forgets what lower layers had set inside it."""
    if _merges(old, new):
        for key, value in new.items():
            _track(old.get(key), value, (*path, key), origin, origins)
        return
    _forget(origins, path)
    if new is None:  # unset: the default's, or the followed key's
        return
    for leaf in _leaves(new) if isinstance(new, dict) and new else [()]:
        origins[(*path, *leaf)] = origin


def _forget(origins: dict[KeyPath, str], path: KeyPath) -> None:
    for stale in [p for p in origins if p[:len(path)] == path]:
        del origins[stale]


def _origin(origins: dict[KeyPath, str], path: KeyPath) -> str:
    if path in origins:
        return origins[path]
    for i in range(len(path) - 1, 0, -1):
        if path[:i] in origins:  # a section replaced by a value: a shorthand sets its kind
            return origins[path[:i]] if path[i:] == ("kind",) else "default"
    return "default"


def _flow(value: Any) -> str:
    """A value as one line of YAML (``[16, 32]``, ``null``, ``1.0e-08``, ``'off'``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def show_config(name_or_path: str = "mlp", overrides: list[str] | None = None) -> str:
    """The resolved config as YAML, each value followed by where it came from.

    The text loads back as the same config: the origins are comments."""
    return show_layers(config_layers(name_or_path, overrides))


def show_layers(layers: list[Layer]) -> str:
    """``show_config`` of the config that ``layers`` give."""
    merged: dict[str, Any] = {}
    origins: dict[KeyPath, str] = {}
    for layer in layers:
        for path in displaced(merged, layer.tree):
            _forget(origins, path)
        _track(merged, layer.tree, (), layer.origin, origins)
        merged = merge(merged, layer.tree)
    resolved = config_from_dict(merged).to_dict()
    origins.update(followed_keys(merged))

    rows: list[tuple[str, str]] = []  # (YAML line, origin or "" for a section header)

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            indent = "  " * len(path)
            here = (*path, key)
            if isinstance(value, dict) and value:
                rows.append((f"{indent}{key}:", ""))
                walk(value, here)
                continue
            rows.append((f"{indent}{key}: {_flow(value)}", _origin(origins, here)))

    walk(resolved, ())
    width = max(len(line) for line, origin in rows if origin) + 2
    return "".join(f"{line.ljust(width)}# {origin}\n" if origin else f"{line}\n"
                   for line, origin in rows)
