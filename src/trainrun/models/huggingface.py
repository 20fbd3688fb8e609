"""Weights in and out of Hugging Face's layout for each ``model_type`` of ``MODEL_TYPES`` (one
module per family under ``families/``, which says its config.json and tensor names both ways):
a model directory of ``config.json`` and ``model.safetensors``, or of shards listed in
``model.safetensors.index.json``, as ``transformers``' ``save_pretrained`` writes it and
``from_pretrained`` reads it. Through ``safetensors`` alone: neither ``transformers`` nor
PyTorch is imported.

A model directory may be on object storage (``gs://``, ``s3://``): its files are read through
the storage layer, each shard's header and tensors by ranged reads, never copied whole.

``config.json`` gives the architecture: every field that changes the maths is either carried
into the transformer's config or refused on one line. Tensors are read lazily, a slice at a
time, so a model can be placed shard by shard on a mesh without the host holding it whole. The
tensor-by-tensor mapping: docs/internals.md, "Hugging Face weights"."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.config import TransformerModel
from trainrun.errors import read_refused
from trainrun.models import safetensors_ranges as ranges
from trainrun.models.families import FAMILIES, MODEL_TYPES
from trainrun.models.families.family import (
    CONFIG,
    HEAD,
    SCORE_TENSOR,
    Architecture,
    Family,
    Source,
    WeightsError,
)
from trainrun.models.families.gpt2 import PREFIX
from trainrun.models.hf_config import checked_model_config
from trainrun.models.reward_transformer import SCORE, body_config
from trainrun.storage import location

Location = location.Location  # a local path, or a gs:// or s3:// one

PyTree = Any
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
# safetensors' float dtypes that numpy (or JAX, for bfloat16) reads as the values they hold
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
BLOCK_ELEMENTS = 2**24  # of a large table compared a block at a time, never read whole
# Files a model directory carries beside its weights, copied by an export from its source.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", GENERATION_CONFIG)


# ---- config.json -----------------------------------------------------------------------------


def family(model_type: object, what: str) -> Family:
    """The family of ``model_type``; one trainrun does not know is refused in one line ending
    ``what`` (e.g. "reads": "... trainrun reads gpt2, llama, ...")."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise WeightsError(f"{what} " + ", ".join(MODEL_TYPES))
    return FAMILIES[model_type]


def architecture(hf: dict[str, Any], where: str = CONFIG) -> Architecture:
    """The transformer a ``config.json`` describes; a value of the wrong type or out of range,
    or a field trainrun cannot compute, is refused in one line naming it."""
    model_type = hf.get("model_type")
    return family(model_type, f"{where} has model_type {model_type!r}; trainrun reads"
                  ).architecture(hf, where)


def refuse_unsupported(hf: dict[str, Any], seq_len: int, where: str = CONFIG) -> None:
    """What ``config.json`` asks checked before a run of ``seq_len`` tokens uses it (every
    value trainrun reads holds what its key takes; sliding windows are computed)."""
    model_type = hf.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES:
        checked_model_config(hf, where, FAMILIES[model_type].schema)


def config_json(cfg: TransformerModel, model_type: str,
                source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` in ``model_type``'s layout. ``source``: the config.json
    the model was loaded from; every field of it is kept as it was but those whose value for
    the model ``cfg`` changed (``kept_source``)."""
    written = family(model_type, f"model_type {model_type!r} is not one trainrun writes; it "
                     "writes")
    return kept_source(written.config_json(cfg, source), source)


def kept_source(out: dict[str, Any], source: dict[str, Any] | None) -> dict[str, Any]:
    """The source's ``config.json`` with ``out``'s value (the model as trained) only where the
    model differs: each field ``architecture`` reads whose value changed, its key written as
    ``out`` writes it, and a longer ``max_position_embeddings``. Every other field stays as the
    source has it (``initializer_range``, keys trainrun does not read, ``rope_theta`` beside
    ``rope_parameters``). ``out`` as it is where there is no source of its model_type, or
    where the source's keys cannot say the change."""
    if not source or source.get("model_type") != out["model_type"]:
        return out
    theirs, ours = architecture(source), architecture(out)
    kept = dict(source)
    for field, value in ours.fields.items():
        if _same(theirs.fields.get(field), value):
            continue
        key = ours.keys.get(field)
        if key is None:
            return out
        for name in ROPE_KEYS if key in ROPE_KEYS else (key,):
            if name in out:
                kept[name] = out[name]
            else:
                kept.pop(name, None)
    if ours.max_positions > theirs.max_positions:
        kept["max_position_embeddings"] = out["max_position_embeddings"]
    back = architecture(kept).fields
    if any(not _same(back.get(field), value) for field, value in ours.fields.items()):
        return out
    return kept


ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling")  # one setting, three spellings


def _same(a: object, b: object) -> bool:
    """Equal, floats within rounding (a value read back from JSON)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b)
    return a == b


def read_config(path: Location) -> dict[str, Any]:
    """A model directory's ``config.json`` as a dict; unreadable is one line."""
    file = path / CONFIG
    data = read_file(file)
    try:
        hf = json.loads(data)
    except ValueError as err:  # not JSON, or not UTF-8 text
        raise WeightsError(f"cannot read {file}: {err}".replace("\n", " ")) from None
    if not isinstance(hf, dict):
        raise WeightsError(f"{file} is not a JSON object; is it a Hugging Face config.json?")
    return hf


def read_file(file: Location) -> bytes:
    """A file of a model directory, local or on object storage; a local file the system will
    not read is its one line, a missing object one naming it (or its missing bucket), a link
    out of the directory one naming the link (``location.model_file``)."""
    local = file.model_file(WeightsError).local_path
    if local is None:
        try:
            return file.read_bytes()
        except FileNotFoundError:
            raise WeightsError(f"{file.missing_line('object')}; the model "
                               "directory is incomplete: copy it again") from None
    try:
        return local.read_bytes()
    except OSError as err:  # not the file's fault: the system's cause, said as such
        raise read_refused(err) from None


# ---- tensors ---------------------------------------------------------------------------------


def tensor_map(cfg: TransformerModel, model_type: str) -> dict[str, Source]:
    """trainrun's dotted param name -> its Hugging Face source, for every base param (LoRA
    adapters have none: ``peft.py``)."""
    return family(model_type, f"model_type {model_type!r} has no tensor layout in trainrun; it "
                  "knows").tensor_map(cfg)


class Tensors:
    """The tensors of a model directory or a ``.safetensors`` file, read lazily: a tensor, or a
    slice of one, is read from its file when asked for, as float32 (bfloat16 and float16 files
    included), and the file is let go again, so its pages do not stay mapped into the process
    while the rest loads. Names of GPT-2 files saved without the ``transformer.`` prefix are
    given it. On object storage (``gs://``, ``s3://``) each file's header and each tensor (or
    the rows of it asked for) is a ranged read (``safetensors_ranges.py``): no file is copied
    to this machine.

    entries: for files on object storage, (file, name as stored) -> where its bytes lie."""

    def __init__(self, headers: dict[Location, dict[str, tuple[tuple[int, ...], str]]],
                 entries: dict[tuple[str, str], ranges.Entry] | None = None):
        self._entries = entries or {}
        self._where: dict[str, tuple[Location, str]] = {}  # name asked -> (file, name stored)
        self._header: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, dtype)
        stored = [name for header in headers.values() for name in header]
        gpt2_body = not any(n.startswith(PREFIX) for n in stored) and any(
            n.startswith("h.") or n == "wte.weight" for n in stored)
        for file, header in headers.items():
            for name, entry in header.items():
                asked = PREFIX + name if gpt2_body and name not in (HEAD, SCORE_TENSOR) else name
                self._where[asked] = (file, name)
                self._header[asked] = entry

    @classmethod
    def of(cls, path: Location | str | os.PathLike[str]) -> Tensors:
        """The tensors of a ``.safetensors`` file, or of a model directory (one file, or the
        shards its ``model.safetensors.index.json`` lists), local or on object storage."""
        path = location.location(path)  # a path given here enters here
        entries: dict[tuple[str, str], ranges.Entry] = {}

        def header(file: Location) -> dict[str, tuple[tuple[int, ...], str]]:
            if file.local_path is not None:
                return _header(file.local_path)
            found = _remote_header(file)
            entries.update({(str(file), name): entry for name, entry in found.items()})
            return {name: (entry.shape, entry.dtype) for name, entry in found.items()}

        if path.is_file():
            return cls({path: header(path)}, entries)
        index = path / INDEX
        if (path / WEIGHTS).is_file():
            weights = (path / WEIGHTS).model_file(WeightsError)
            return cls({weights: header(weights)}, entries)
        if not index.is_file():
            raise WeightsError(f"{path} has neither {WEIGHTS} nor {INDEX}; save the model with "
                               "save_pretrained (safetensors)")
        text = read_file(index)
        try:
            weight_map = json.loads(text)["weight_map"]
            files = {str(name): path / str(file) for name, file in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightsError(f"{index} is not a safetensors index (a JSON object with a "
                               "weight_map); save the model again") from None
        headers = {}
        for file in sorted(set(files.values()), key=str):
            if str(file.parent) != str(path) or not file.is_file():
                raise WeightsError(f"{index} lists {file.name}, which is not in {path}; the "
                                   "download is incomplete")
            found = header(file.model_file(WeightsError))
            listed = {n for n, f in files.items() if f == file}
            if listed - set(found):
                raise WeightsError(f"{file.name} lacks tensor {sorted(listed - set(found))[0]!r} "
                                   f"that {INDEX} places there; the download is incomplete")
            headers[file] = {n: e for n, e in found.items() if n in listed}
        return cls(headers, entries)

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._header[name][0]

    def dtype(self, name: str) -> str:
        """safetensors' name of the tensor's dtype: F32, BF16, I64, BOOL, ..."""
        return self._header[name][1]

    def file(self, name: str) -> Location:
        return self._where[name][0]

    def check_floats(self, names: set[str] | list[str]) -> None:
        """Each of ``names`` holds floats: an integer or boolean tensor would be trained as
        floats, so it is refused on one line naming it, its dtype and its file."""
        for name in sorted(names):
            if self.dtype(name) not in FLOAT_DTYPES:
                raise WeightsError(f"tensor {name} in {self.file(name)} has dtype "
                                   f"{self.dtype(name)}; trainrun reads float weights "
                                   f"({', '.join(FLOAT_DTYPES)}): give the model's float "
                                   "weights")

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """``name``'s values (``index``: a slice of them) as float32."""
        from safetensors import safe_open

        file, stored = self._where[name]
        local = file.local_path
        if local is None:
            try:
                value = ranges.read_tensor(file, self._entries[str(file), stored], index)
            except ranges.Unreadable as err:
                raise WeightsError(f"cannot read tensor {name} from {file}: {err}") from None
            return np.asarray(value, np.float32)
        try:
            if self._header[name][1] == "BF16":  # numpy has no bfloat16: read through JAX
                import jax

                with (jax.default_device(jax.local_devices(backend="cpu")[0]),
                      safe_open(str(file), framework="flax") as f):
                    value = np.asarray(f.get_slice(stored)[index or ...])
            else:
                with safe_open(str(file), framework="numpy") as f:
                    value = f.get_slice(stored)[index or ...]
        except Exception as err:  # safetensors' own error types are not importable from numpy
            refuse_unreadable(local)  # safetensors says "No such file" for a denied read too
            raise WeightsError(f"cannot read tensor {name} from {file}: {err}"
                               .replace("\n", " ")) from None
        return np.asarray(value, np.float32)


def refuse_unreadable(file: Path) -> None:
    """Raise the system's own refusal to read ``file`` (permission denied: exit 1), if any;
    safetensors reports every failure to open a file as "No such file or directory"."""
    try:
        with open(file, "rb"):
            pass
    except OSError as err:
        raise read_refused(err) from None


def _remote_header(file: Location) -> dict[str, ranges.Entry]:
    """Each tensor's entry in a safetensors object, from its header (ranged reads)."""
    try:
        return ranges.read_header(file)
    except FileNotFoundError:
        raise WeightsError(f"{file.missing_line('object')}; the model directory is "
                           "incomplete: copy it again") from None
    except ranges.Unreadable as err:
        raise WeightsError(f"cannot read {file}: {err}; is the file complete?") from None


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and dtype in a safetensors file, from its header."""
    from safetensors import safe_open

    refuse_unreadable(file)
    try:
        with safe_open(str(file), framework="numpy") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                    for name in f.keys()}  # noqa: SIM118  # safe_open is not a mapping
    except Exception as err:  # SafetensorError: truncated, not safetensors, unreadable
        raise WeightsError(f"cannot read {file}: {err}; is the file complete?"
                           .replace("\n", " ")) from None


def check_tensors(tensors: Tensors, wanted: dict[str, Source], shapes: dict[str, tuple[int, ...]],
                  where: str) -> None:
    """Every source tensor present, of floats and of the shape its params need, and none left
    over (a tied head's copy of the embedding excepted: ``separate_head`` tells a copy)."""
    needed: dict[str, tuple[int, ...]] = {}
    for param, source in wanted.items():
        shape = shapes[param]
        if source.stack:  # one tensor per expert, each the param's shape less its first axis
            for name in source.stack:
                needed[name] = shape[1:][::-1] if source.transpose else shape[1:]
            continue
        if source.span is not None:  # a fused tensor: params side by side on the last axis
            shape = (*shape[:-1], source.fused)
        full = shape[::-1] if source.transpose else shape
        needed[source.name] = full
    leftover = sorted(tensors.names - set(needed) - {HEAD}  # tied: a copy
                      - {n for n in tensors.names if n.endswith(".attn.bias")
                         or n.endswith(".attn.masked_bias")})  # GPT-2's causal-mask buffers
    if leftover:
        raise WeightsError(f"tensor {leftover[0]!r} in {where} has no place in the model "
                           f"({len(leftover)} such); does config.json match the weights?")
    for name, shape in needed.items():
        if name not in tensors.names:
            raise WeightsError(f"tensor {name} is missing from {where}")
        if tensors.shape(name) != shape:
            raise WeightsError(f"tensor {name} has shape {tensors.shape(name)} in {where}; the "
                               f"model needs {shape} (does config.json match the weights?)")
    tensors.check_floats(set(needed))


def separate_head(tensors: Tensors, model_type: str) -> bool:
    """Whether the weights hold an ``lm_head.weight`` that is not a copy of the embedding.
    ``transformers`` then loads it as a head of its own whatever ``tie_word_embeddings`` says
    (``PreTrainedModel.tie_weights`` ties only equal tensors), so trainrun unties it too. The
    two are compared a block of rows at a time, never whole in memory."""
    embedding = family(model_type, f"model_type {model_type!r} has no tensor layout in "
                       "trainrun; it knows").embedding
    if HEAD not in tensors.names or embedding not in tensors.names:
        return False  # no head: tied; no embedding: check_tensors names it missing
    shape = tensors.shape(HEAD)
    if shape != tensors.shape(embedding):
        return True
    if not shape:
        return not np.array_equal(tensors.read(HEAD), tensors.read(embedding))
    rows = max(1, BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], rows):
        block = (slice(start, min(start + rows, shape[0])), *(slice(None),) * (len(shape) - 1))
        if not np.array_equal(tensors.read(HEAD, block), tensors.read(embedding, block)):
            return True
    return False


def read_param(tensors: Tensors, source: Source,
               index: tuple[slice, ...] | None = None) -> np.ndarray:
    """The param ``source`` gives (``index``: the part of it in trainrun's layout), float32."""
    if source.stack:
        first, rest = (index[0], index[1:]) if index else (slice(None), None)
        names = source.stack[first]
        parts = [read_param(tensors, Source(name, source.transpose), rest or None)
                 for name in names]
        return np.stack(parts)
    if source.span is not None:  # a fused tensor: this param's part of its last axis
        lo, hi = source.span
        index = index or (slice(None),) * len(tensors.shape(source.name))
        start, stop, _ = index[-1].indices(hi - lo)
        index = (*index[:-1], slice(lo + start, lo + stop))
    if index is not None and source.transpose:
        index = index[::-1]
    value = tensors.read(source.name, index)
    return value.T if source.transpose else value


# ---- writing ---------------------------------------------------------------------------------


def hf_tensors(params: dict[str, np.ndarray], cfg: TransformerModel,
               model_type: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, float32 tensor)`` in Hugging Face's layout from trainrun's dotted params; a
    reward model's (``score`` beside the transformer's) as its ``...ForSequenceClassification``
    holds them: ``score.weight`` and no output head."""
    if SCORE in params:
        cfg = body_config(cfg)
        yield SCORE_TENSOR, np.ascontiguousarray(np.asarray(params[SCORE], np.float32))
    fused: dict[str, list[tuple[int, np.ndarray]]] = {}
    transposed: dict[str, bool] = {}
    for param, source in tensor_map(cfg, model_type).items():
        value = np.asarray(params[param], np.float32)
        for name, part in zip(source.stack, value, strict=False):
            yield name, np.ascontiguousarray(part.T if source.transpose else part)
        if source.stack:
            continue
        if source.span is not None:
            fused.setdefault(source.name, []).append((source.span[0], value))
            transposed[source.name] = source.transpose
            continue
        yield source.name, np.ascontiguousarray(value.T if source.transpose else value)
    for name, parts in fused.items():
        whole = np.concatenate([v for _, v in sorted(parts, key=lambda p: p[0])], axis=-1)
        yield name, np.ascontiguousarray(whole.T if transposed[name] else whole)


def write_weights(tensors: Iterator[tuple[str, np.ndarray]], path: Path, *,
                  dtype: str = "float32", shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Tensors as ``model.safetensors``, or as shards of at most ``shard_bytes`` with
    ``model.safetensors.index.json`` where they need more than one, one shard in memory at a
    time. ``dtype``: float32, bfloat16 or float16."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    shard: dict[str, np.ndarray] = {}
    written: list[tuple[Path, list[str]]] = []
    total = size = 0
    for name, value in tensors:
        nbytes = value.size * itemsize
        if shard and size + nbytes > shard_bytes:
            written.append((_write_shard(shard, path / f".shard-{len(written)}", dtype),
                            list(shard)))
            shard, size = {}, 0
        shard[name] = value
        size += nbytes
        total += nbytes
    written.append((_write_shard(shard, path / f".shard-{len(written)}", dtype), list(shard)))
    if len(written) == 1:
        return [written[0][0].rename(path / WEIGHTS)]
    files, weight_map = [], {}
    for i, (file, names) in enumerate(written):
        final = file.rename(path / f"model-{i + 1:05d}-of-{len(written):05d}.safetensors")
        files.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": dict(sorted(weight_map.items()))},
                                         indent=2) + "\n")
    return files


def write_model_dir(params: PyTree, cfg: TransformerModel, path: Path, *, model_type: str,
                    source: dict[str, Any] | None = None, dtype: str = "float32",
                    shard_bytes: int = 5 * 2**30) -> Path:
    """``config.json`` and the weights (sharded above ``shard_bytes``) of ``params`` (a nested
    dict, without adapters) in ``model_type``'s layout, which ``transformers`` loads with
    ``from_pretrained``. ``source``: the config.json the model came from (kept fields). A
    reward model's params (``score`` among them) are written as the family's
    ``...ForSequenceClassification`` (``classifier_config``)."""
    hf = config_json(cfg, model_type, source)
    if SCORE in params:
        hf = classifier_config(hf, cfg, model_type)
    for key in [k for k in ("dtype", "torch_dtype") if k in hf] or ["dtype"]:
        hf[key] = dtype  # the weights' dtype, under the source's spelling (older: torch_dtype)
    path.mkdir(parents=True, exist_ok=True)
    write_weights(hf_tensors(dotted(params), cfg, model_type), path, dtype=dtype,
                  shard_bytes=shard_bytes)
    (path / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    return path


def classifier_config(hf: dict[str, Any], cfg: TransformerModel,
                      model_type: str) -> dict[str, Any]:
    """A causal LM's ``config.json`` ``hf`` as its family's ``...ForSequenceClassification``
    with one label, a reward model: it reads the score at each sequence's last token that is
    not ``pad_token_id`` (``model.pad_id``), which it must therefore have."""
    if cfg.pad_id is None:
        raise WeightsError("the reward model has no model.pad_id, and transformers' "
                           "ForSequenceClassification reads its score by pad_token_id: set "
                           "model.pad_id (the tokenizer's pad token, or its end of text)")
    out = {key: value for key, value in hf.items() if key != "num_labels"}
    architecture = family(model_type, f"model_type {model_type!r} is not one trainrun writes; "
                          "it writes").classifier
    return {**out, "architectures": [architecture], "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}, "pad_token_id": cfg.pad_id}


def dotted(tree: PyTree, prefix: str = "") -> dict[str, np.ndarray]:
    """A nested dict of arrays as ``{"blocks.0.attn.q.kernel": array, ...}``."""
    if not isinstance(tree, dict):
        return {prefix: np.asarray(tree)}
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        out.update(dotted(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def model_type_of(cfg: TransformerModel) -> str:
    """The Hugging Face family a transformer's layout is (for a model that came from none);
    a layout that is no family's is refused in one line."""
    for model_type, written in FAMILIES.items():
        if written.writes_fresh(cfg):
            return model_type
    raise WeightsError(f"the model's layout ({cfg.norm}, {cfg.mlp} MLP, {cfg.positions} "
                       "positions) is no Hugging Face family's: train with GPT-2's "
                       "(model.positions=learned, model.bias=true) or the Llama family's "
                       "(model.norm=rmsnorm, model.mlp=swiglu) to export")


def _write_shard(tensors: dict[str, np.ndarray], file: Path, dtype: str) -> Path:
    if dtype == "float32":
        from safetensors.numpy import save_file

        save_file(tensors, str(file), metadata={"format": "pt"})
        return file
    import jax
    import jax.numpy as jnp
    from safetensors.flax import save_file as save_arrays

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        save_arrays({n: jnp.asarray(v, dtype) for n, v in tensors.items()}, str(file),
                    metadata={"format": "pt"})
    return file


def parse_size(text: str) -> int:
    """A size as bytes: a number with an optional unit (KB, MB, GB, TB; KiB, MiB, ...)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not match:
        raise WeightsError(f"shard size {text!r} is not a size; give e.g. 5GB or 500MB")
    number, unit = float(match.group(1)), match.group(2).rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = " KMGT".index(unit[:1] or " ")
    return max(1, math.floor(number * base ** power))
