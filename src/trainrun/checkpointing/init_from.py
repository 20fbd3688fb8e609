"""What a fresh run starts from when ``init.from`` names a source instead of random init:

    a trainrun run directory      its newest readable checkpoint: the params (``init.load:
                                  params``) or the whole state (``state``: optimizer moments,
                                  step, key and loss scale too: a fork of that run)
    a Hugging Face directory      ``config.json`` + ``model.safetensors`` (or shards and their
                                  index) of a model_type in huggingface.MODEL_TYPES
    a PEFT adapter directory      ``adapter_config.json`` + ``adapter_model.safetensors``: its
                                  base model (a Hugging Face directory) with the adapters
    a ``.safetensors`` file       Hugging Face's tensor names, or trainrun's dotted param paths
                                  (``blocks.0.attn.q.kernel``)

A Hugging Face source's ``config.json`` gives the architecture (``resolved``): the run's model
section need not repeat it, and a value it repeats must agree. Every param of the source must
be a param of the model with the same shape; a model param the source lacks is an error, except
LoRA adapters, which keep their fresh init (a fine-tune adds them to a pretrained base). Each
param is read from its file a slice at a time and placed straight into its sharded device
array. Loading happens before the run directory is written, so a source that does not fit is
one line and exit 2 with nothing created.

A reward model (a score head in place of the output head: ``models/reward_transformer.py``)
reads ``score.weight`` where the source has it (a ``...ForSequenceClassification``
checkpoint, or a reward run); from a language model the output head is left out and the score
head is drawn fresh, as a fresh run draws it.

A Hugging Face or adapter directory (or a ``.safetensors`` file) may be on object storage
(``gs://``, ``s3://``, an adapter's base model too): read through the storage layer, each
shard's tensors by ranged reads, as from disk, with nothing copied to this machine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pydantic
from pydantic import BaseModel

from trainrun import extras, rundir
from trainrun.config import (
    ARCHITECTURE,
    ConfigError,
    RecordsData,
    RunConfig,
    TransformerModel,
    config_from_dict,
)
from trainrun.data import model_tokenizer
from trainrun.models import peft
from trainrun.models.adapters import Model
from trainrun.models.families import FAMILIES
from trainrun.models.huggingface import (
    CONFIG,
    INDEX,
    SCORE_TENSOR,
    WEIGHTS,
    Architecture,
    Source,
    Tensors,
    WeightsError,
    architecture,
    check_tensors,
    read_config,
    read_param,
    refuse_unsupported,
    separate_head,
    tensor_map,
)
from trainrun.models.reward_transformer import SCORE, body_config, score_init
from trainrun.models.transformer import adapter_draws, split_adapters
from trainrun.program.optim import Optimizer, param_name
from trainrun.program.precision import Policy
from trainrun.program.state import INIT_COMPILER_OPTIONS, TrainState, root_keys
from trainrun.storage import location

PyTree = Any
Location = location.Location  # a local path, or a gs:// or s3:// one
ADAPTER = "_lora."  # params a source may lack: they keep their fresh init
Reader = Callable[[tuple[slice, ...] | None], np.ndarray]  # a param, or a slice of it


def source_location(source: str) -> Location:
    """Where ``init.from`` enters: a ``gs://``/``s3://`` location, or a local path (``~``
    expanded)."""
    return location.location(source)


def source_kind(path: Location | str | os.PathLike[str], what: str = "init.from") -> str:
    """"run", "huggingface", "adapter" or "safetensors"; anything else is refused in one line
    that says what was found and what is read. what: how the line names the path's origin.
    ``path``: local, or on object storage (``source_location``)."""
    path = location.location(path)  # a path given here enters here
    if (path / rundir.CONFIG).is_file():
        return "run"
    if (path / peft.ADAPTER_CONFIG).is_file():
        extras.require("huggingface", f"{what} {path}")
        return "adapter"
    if (path / CONFIG).is_file():
        if not ((path / WEIGHTS).is_file() or (path / INDEX).is_file()):
            raise _weights_unread(path, what)
        extras.require("huggingface", f"{what} {path}")
        return "huggingface"
    if path.suffix == ".safetensors" and path.is_file():
        extras.require("huggingface", f"{what} {path}")
        return "safetensors"
    raise _not_a_source(path, what)


def _weights_unread(path: Location, what: str) -> WeightsError:
    """The line for a model directory (``config.json``) without safetensors weights: the
    PyTorch ``.bin`` weights it holds instead, or none."""
    if any(name.startswith("pytorch_model") and name.endswith(".bin")
           for name in path.list_names()):
        return WeightsError(f"{what} {path}: its weights are pytorch_model.bin, which "
                            "trainrun does not read; save them as safetensors "
                            "(save_pretrained(..., safe_serialization=True))")
    return WeightsError(f"{what} {path}: config.json but no {WEIGHTS} or {INDEX}; the "
                        "weights are missing (an incomplete download?)")


def _not_a_source(path: Location, what: str) -> WeightsError:
    """The line for a path that holds no source ``source_kind`` reads: a PyTorch ``.bin``
    file, nothing at all (a hub name given for a local path is told so), or something else."""
    if path.suffix == ".bin" and path.is_file():
        return WeightsError(f"{what} {path}: a PyTorch .bin file, which trainrun does not "
                            "read; save the model as safetensors")
    if path.local_path is None:
        if not path.is_file() and not path.is_dir():
            return WeightsError(f"{what}: {path.missing_line('object or folder')}; "
                                "give the location of a run, a model directory or an adapter "
                                "directory")
    elif not path.exists():
        hub = "/" in str(path) and not str(path).startswith((".", "/", "~"))
        hint = (f"; a hub name is not fetched: download it (e.g. `hf download {path} "
                "--local-dir DIR`) and give DIR" if hub else "")
        return WeightsError(f"{what} {path}: no such file or directory{hint}")
    return WeightsError(f"{what} {path}: not a trainrun run directory, a Hugging Face model "
                        "directory (config.json + model.safetensors), a PEFT adapter directory "
                        "or a .safetensors file")


# ---- the architecture ------------------------------------------------------------------------


def resolved(config: RunConfig) -> RunConfig:
    """``config`` with the transformer ``init.from`` holds: what a Hugging Face directory's
    ``config.json`` describes (and, for an adapter directory, its LoRA settings), or a run's
    model (its adapters included). A field the run's config sets to another value is refused
    in one line naming both."""
    if config.init.from_ is None or not isinstance(config.model, TransformerModel):
        return config
    path = source_location(config.init.from_)
    kind = source_kind(path)
    seq_len = getattr(config.data, "seq_len", None)
    if kind == "run":
        from trainrun.checkpointing.reader import saved_config

        source = saved_config(path).model
        if not isinstance(source, TransformerModel):
            return config  # another kind of model: its params are refused by name
        model = _agreed(config.model, _run_architecture(source), path / rundir.CONFIG,
                        seq_len)
    elif kind in ("huggingface", "adapter"):
        model = model_of(path, config.model, seq_len)
    else:
        return config
    raw = config.to_dict()
    raw["model"] = model.model_dump(mode="json")
    if isinstance(config.data, RecordsData) and config.data.tokenizer is None:
        raw["data"]["tokenizer"], template = records_tokenizer(path, kind)
        if config.data.chat_template is None:
            raw["data"]["chat_template"] = template
    try:
        return config_from_dict(raw)
    except ConfigError as err:
        raise ConfigError(f"with the model of {path}: {err}") from None


def records_tokenizer(path: Location, kind: str) -> tuple[str, str | None]:
    """The tokenizer records are encoded with when a run names none, and the chat template in
    place of its own (None: its own): the model directory's (an adapter directory's own, else
    its base model's), or the source run's."""
    if kind == "run":
        from trainrun.checkpointing.reader import saved_config
        from trainrun.data.kept_tokenizer import records_as_trained

        data = records_as_trained(path, saved_config(path).data)  # the tokenizer it keeps
        if not isinstance(data, RecordsData):
            return model_tokenizer.BYTES, None
        return data.tokenizer or model_tokenizer.BYTES, data.chat_template
    if kind == "adapter" and not (path / "tokenizer.json").is_file():
        return str(_adapter_base(path)), None
    return str(path), None


def model_of(path: Location | str | os.PathLike[str], model: TransformerModel | None = None,
             seq_len: int | None = None, *, full_context: bool = False,
             seq_len_key: str = "data.seq_len") -> TransformerModel:
    """The transformer a Hugging Face or adapter directory holds. ``model``: the run's model
    section, whose other fields (dropout, remat, ...) are kept and whose repeated fields must
    agree; ``seq_len``: the run's sequence length (``seq_len_key`` names it in a refusal), the
    context of a rotary model; ``full_context``: without ``seq_len``, the context config.json
    gives (``max_position_embeddings``)."""
    path = location.location(path)  # a path given here enters here
    model = model or TransformerModel()
    adapter = (path / peft.ADAPTER_CONFIG).is_file()
    base = _adapter_base(path) if adapter else path
    hf = read_config(base)
    arch = architecture(hf, str(base / CONFIG))
    if arch.fields["tie_embeddings"] and separate_head(Tensors.of(base), arch.model_type):
        if "tie_embeddings" in model.model_fields_set and model.tie_embeddings:
            raise WeightsError(f"model.tie_embeddings=true in the config, but the weights of "
                               f"{base} hold an lm_head.weight that differs from the "
                               "embedding, which transformers loads as a head of its own: drop "
                               "model.tie_embeddings")
        # as transformers loads it: tie_word_embeddings holds only for an equal head
        arch = dataclasses.replace(arch, fields={**arch.fields, "tie_embeddings": False})
    if seq_len is None and full_context and arch.max_positions:
        seq_len = arch.max_positions
    agreed = _agreed(model, arch, base / CONFIG, seq_len, seq_len_key)
    refuse_unsupported(hf, agreed.seq_len, str(base / CONFIG))
    if not adapter:
        return agreed
    settings, _ = peft.read_adapter_dir(path, agreed, arch.model_type)
    wanted = settings.config()
    if model.lora is not None and model.lora != wanted:
        raise WeightsError(f"model.lora={model.lora.model_dump()} in the config, but {path} "
                           f"holds adapters {wanted.model_dump()}; drop model.lora or make it "
                           "agree")
    return agreed.model_copy(update={"lora": wanted})


def _adapter_base(path: Location) -> Location:
    """The base model an adapter directory names: a local path (relative ones tried inside the
    adapter directory first) or a ``gs://``/``s3://`` location."""
    name = peft.base_model_name(path)
    base = location.location(name) if name else None  # where the name enters: as written
    if (name and base is not None and base.local_path is not None
            and not name.startswith(("/", "~")) and (path / name).is_dir()):
        base = path / name  # a relative name: inside the adapter directory first
    if base is None or not (base / CONFIG).is_file():
        raise WeightsError(f"init.from {path}: its base model {name!r} "
                           "(base_model_name_or_path) is not a Hugging Face directory here or "
                           "on object storage; download it and set base_model_name_or_path in "
                           "adapter_config.json")
    return base




def _run_architecture(source: TransformerModel) -> Architecture:
    fields = {name: getattr(source, name) for name in ARCHITECTURE}
    if source.lora is not None:  # its adapters are params of the model too
        fields["lora"] = source.lora
    return Architecture("run", fields, {}, 0)


# Fields compared by what they mean: kv_heads None and kv_heads == heads are the same model.
_EFFECTIVE = {"kv_heads": "kv_key_heads", "head_dim": "attention_head_dim",
              "mlp_hidden": "hidden", "mlp_ratio": "hidden"}


def _agreed(model: TransformerModel, arch: Architecture, described_by: Location,
            data_seq_len: int | None, seq_len_key: str = "data.seq_len") -> TransformerModel:
    """``model`` with ``arch``'s fields (the file ``described_by`` gives them); a field the
    model sets to another value is refused, naming both. ``data_seq_len``: the length the run
    reads (``seq_len_key`` names it), refused past the context the source gives."""
    fields = dict(arch.fields)
    if fields.get("positions") == "rope":  # the context is the run's choice, up to the model's
        own = "seq_len" in model.model_fields_set
        wanted = model.seq_len if own else (
            data_seq_len or min(arch.max_positions or model.seq_len, model.seq_len))
        if arch.max_positions and wanted > arch.max_positions:
            given = "model.seq_len" if own else seq_len_key
            raise WeightsError(f"{given}={wanted} is longer than the model's context: "
                               f"max_position_embeddings {arch.max_positions} in "
                               f"{described_by}; give {given}={arch.max_positions} or less")
        fields["seq_len"] = wanted
    try:
        candidate = TransformerModel.model_validate({**model.model_dump(), **{
            k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}})
    except pydantic.ValidationError as err:  # a value, or sizes that do not fit together
        first = err.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        field = str(first["loc"][0]) if first["loc"] else None
        if field is None:
            raise WeightsError(f"the model {described_by} describes cannot be built: "
                               f"{message}") from None
        if field in fields:
            raise WeightsError(f"{described_by} has {arch.keys.get(field, field)} "
                               f"{first['input']!r}, which trainrun's transformer does not take "
                               f"({message})") from None
        raise WeightsError(f"model.{field}={first['input']!r} does not fit the model of "
                           f"{described_by} ({message})") from None
    compared = set(fields) | ({"mlp_ratio"} if "mlp_hidden" in fields else set())
    for field in sorted(model.model_fields_set & compared):
        attr = _EFFECTIVE.get(field, field)
        mine, theirs = getattr(model, attr), getattr(candidate, attr)
        if mine != theirs:
            key = arch.keys.get("mlp_hidden" if field == "mlp_ratio" else field, field)
            raise WeightsError(f"model.{field} gives {attr}={_show(mine)} in the config, but "
                               f"{described_by} has {key} {_show(theirs)}; drop model.{field} "
                               "(the source gives it) or make it agree")
    if data_seq_len and data_seq_len > candidate.seq_len:  # learned positions: a table's size
        key, size = arch.keys.get("seq_len", "model.seq_len"), candidate.seq_len
        raise WeightsError(f"{seq_len_key}={data_seq_len} is longer than the model's context: "
                           f"{key} {size} in {described_by}; give {seq_len_key}={size} or less")
    return candidate


def _show(value: Any) -> str:
    return str(value.model_dump()) if isinstance(value, BaseModel) else repr(value)


# ---- the params ------------------------------------------------------------------------------


def readers(source: str, model: Any, abstract_params: PyTree, seed: int = 0
            ) -> dict[str, Reader]:
    """Dotted param name -> a reader of it, for every param the source has; checked against
    the model's params (``abstract_params``): names, shapes, and no base param missing. A
    reward model's score head the source lacks is drawn as a fresh run of ``seed`` draws it."""
    path = source_location(source)
    kind = source_kind(path)
    shapes = {param_name(p): tuple(a.shape)
              for p, a in jax.tree_util.tree_leaves_with_path(abstract_params)}
    if kind == "run":
        from trainrun.checkpointing.reader import latest_params, saved_config

        _, params = latest_params(path, saved_config(path))
        found = {param_name(p): np.asarray(x)
                 for p, x in jax.tree_util.tree_leaves_with_path(params)}
        if SCORE in shapes:  # a reward model: a language model's output head has no place
            found.pop("head", None)
        return _with_score(_checked(_from_arrays(found), _shapes(found), shapes, str(path)),
                           model, shapes, seed)
    if not isinstance(model, TransformerModel):
        raise WeightsError(f"init.from {path}: Hugging Face weights need "
                           f"model.kind=transformer (this run's is {model.kind})")
    cfg = model
    base_cfg = cfg.model_copy(update={"lora": None})
    if kind in ("huggingface", "adapter"):
        base = _adapter_base(path) if kind == "adapter" else path
        model_type = str(read_config(base).get("model_type"))
        tensors = Tensors.of(base)
        out = _from_hf(tensors, base_cfg, model_type, shapes, str(base))
        if kind == "adapter":
            _, adapters = peft.read_adapter_dir(path, cfg, model_type)
            out.update(_checked(_from_arrays(adapters), _shapes(adapters), shapes, str(path),
                                complete=False))
        return _with_score(out, cfg, shapes, seed)
    tensors = Tensors.of(path)
    names = tensors.names
    layout = next((t for t, family in FAMILIES.items() if family.reads_bare(names)), None)
    if layout is not None:  # Hugging Face's names, of the first family whose layout they are
        return _with_score(_from_hf(tensors, base_cfg, layout, shapes, str(path)), cfg,
                           shapes, seed)
    sizes = {n: tensors.shape(n) for n in names}
    tensors.check_floats(names)
    return _checked({n: _tensor_reader(tensors, Source(n)) for n in names}, sizes, shapes,
                    str(path))


def _from_hf(tensors: Tensors, cfg: TransformerModel, model_type: str,
             shapes: dict[str, tuple[int, ...]], where: str) -> dict[str, Reader]:
    scored = SCORE in shapes  # a reward model: its score head in place of the output head
    if scored:
        cfg = body_config(cfg)
    elif cfg.tie_embeddings and separate_head(tensors, model_type):
        raise WeightsError(f"{where} holds an lm_head.weight that differs from the embedding, "
                           "but model.tie_embeddings is true: set model.tie_embeddings=false "
                           "to load it as the output head")
    wanted = tensor_map(cfg, model_type)
    if scored and SCORE_TENSOR in tensors.names:
        wanted[SCORE] = Source(SCORE_TENSOR)
    unknown = sorted(set(wanted) - set(shapes))
    if unknown:  # the model lacks a param the layout has (bias, head, positions)
        raise WeightsError(f"{where} has {wanted[unknown[0]].name}, which this model has no "
                           f"param for ({unknown[0]}); check the model settings against it")
    check_tensors(tensors, wanted, shapes, where)
    found = {param: _tensor_reader(tensors, source) for param, source in wanted.items()}
    missing = sorted(n for n in set(shapes) - set(found) if ADAPTER not in n and n != SCORE)
    if missing:
        raise WeightsError(f"{where} has no tensor for param {missing[0]!r} of this model "
                           f"({len(missing)} such); check the model settings against it")
    return found


def _with_score(found: dict[str, Reader], cfg: Any, shapes: dict[str, tuple[int, ...]],
                seed: int) -> dict[str, Reader]:
    """``found`` with a reward model's score head drawn fresh where the source has none (it
    was a language model), the bits a fresh run of ``seed`` draws (``init_state``'s
    compilation); as it is for any other model."""
    if SCORE not in shapes or SCORE in found:
        return found
    assert isinstance(cfg, TransformerModel)  # a reward model is a transformer
    draw = jax.jit(lambda: score_init(root_keys(seed)[0], cfg))
    fresh = np.asarray(draw.lower().compile(compiler_options=INIT_COMPILER_OPTIONS)())
    return {**found, SCORE: _array_reader(fresh)}


def _tensor_reader(tensors: Tensors, source: Source) -> Reader:
    def read(index: tuple[slice, ...] | None) -> np.ndarray:
        return read_param(tensors, source, index)

    return read


def _array_reader(array: np.ndarray) -> Reader:
    def read(index: tuple[slice, ...] | None) -> np.ndarray:
        return np.asarray(array if index is None else array[index])

    return read


def _from_arrays(arrays: dict[str, np.ndarray]) -> dict[str, Reader]:
    return {name: _array_reader(value) for name, value in arrays.items()}


def _shapes(arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(np.shape(value)) for name, value in arrays.items()}


def _checked(found: dict[str, Reader], sizes: dict[str, tuple[int, ...]],
             shapes: dict[str, tuple[int, ...]], source: str,
             complete: bool = True) -> dict[str, Reader]:
    """``found`` after checking the source's names and ``sizes`` against the model's
    ``shapes``; ``complete``: every base param must be there (not so for adapters alone)."""
    unknown = sorted(set(found) - set(shapes))
    if unknown:
        raise WeightsError(f"{source} has param {unknown[0]!r}, which this model does not have "
                           f"({len(unknown)} such); check model settings against the source")
    missing = sorted(n for n in set(shapes) - set(found) if ADAPTER not in n and n != SCORE)
    if missing and complete:
        raise WeightsError(f"{source} lacks param {missing[0]!r} of this model "
                           f"({len(missing)} such); check model settings against the source")
    for name, shape in sizes.items():
        if shape != shapes[name]:
            raise WeightsError(f"param {name!r} has shape {shape} in {source}; the model's is "
                               f"{shapes[name]}")
    return found


def placed_params(found: dict[str, Reader], seed: int, abstract_params: PyTree,
                  shardings: PyTree | None) -> PyTree:
    """The model's params, each read from its source straight into its place: every device
    gets its shard from a read of that slice alone, so the host never holds the whole model
    beside the device copy. Params the source lacks (LoRA adapters) are the fresh init's, the
    same bits ``init_state`` draws."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract_params)
    names = [param_name(p) for p, _ in leaves]
    placement = (jax.tree.leaves(shardings) if shardings is not None
                 else [jax.sharding.SingleDeviceSharding(jax.local_devices()[0])] * len(names))
    shapes = {name[:-len(".a")]: tuple(abstract.shape)
              for name, (_, abstract) in zip(names, leaves, strict=True)
              if ADAPTER in name and name.endswith(".a")}
    missing = [name for name in names if name not in found]
    # The adapters' draw compiles on a thread of its own while the source is read.
    with concurrent.futures.ThreadPoolExecutor(1, "trainrun-fresh-init") as thread:
        drawn = thread.submit(_adapter_draws, seed, shapes if missing else {})
        sources = {**found, **{name: _fresh_adapter(name, abstract.shape, drawn)
                               for name, (_, abstract) in zip(names, leaves, strict=True)
                               if name in missing}}
        params = {name: jax.make_array_from_callback(abstract.shape, sharding,
                                                     _cast(sources[name], abstract.dtype))
                  for name, (_, abstract), sharding in sorted(
                      zip(names, leaves, placement, strict=True),
                      key=lambda leaf: leaf[0] in found, reverse=True)}  # the source's first
    return jax.tree_util.tree_unflatten(tree, [params[name] for name in names])


def _cast(read: Reader, dtype: Any) -> Reader:
    return lambda index: np.asarray(read(index), dtype)


def _adapter_draws(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Each adapter's ``A`` as a fresh run draws it (``transformer.adapter_draws``, in a
    program compiled as ``init_state``'s), on the host."""
    if not shapes:
        return {}
    draw = jax.jit(lambda: adapter_draws(root_keys(seed)[0], shapes))
    return split_adapters(np.asarray(draw.lower().compile(
        compiler_options=INIT_COMPILER_OPTIONS)()), shapes)


def _fresh_adapter(name: str, shape: tuple[int, ...],
                   drawn: concurrent.futures.Future[dict[str, np.ndarray]]) -> Reader:
    """A reader of a param the source lacks: an adapter's ``A`` as drawn, or its ``B``,
    zeros."""
    if ADAPTER not in name or not name.endswith((".a", ".b")):
        raise WeightsError(f"the source has no tensor for param {name!r}, which is not a "
                           "LoRA adapter; check the model settings against it")
    adapter, part = name.rsplit(".", 1)

    def read(index: tuple[slice, ...] | None) -> np.ndarray:
        whole = drawn.result()[adapter] if part == "a" else np.zeros(shape, np.float32)
        return whole if index is None else whole[index]

    return read


def initial_state(config: RunConfig, model: Model, optimizer: Optimizer, policy: Policy,
                  shardings: TrainState | None, abstract: TrainState) -> TrainState:
    """The state a fresh run starts from under ``config.init`` (``abstract``: the state's
    shapes, which a whole state loaded with ``load: state`` must match)."""
    from trainrun.program.state import state_from_params

    source = config.init.from_
    if source is None:
        raise ValueError("initial_state starts a run from init.from, which is not set")
    if config.init.load == "params":
        found = readers(source, config.model, abstract.params, config.seed)
        params = placed_params(found, config.seed, abstract.params,
                               None if shardings is None else shardings.params)
        model_state = None
        if model.init_model_state is not None:
            model_state = jax.jit(lambda: model.init_model_state(  # type: ignore[misc]
                root_keys(config.seed)[0]))()
        return state_from_params(params, optimizer, config.seed, policy, shardings, model_state)
    path = source_location(source)
    if source_kind(path) != "run":
        raise WeightsError(f"init.load=state needs a trainrun run directory; {path} holds "
                           "weights only (use init.load=params)")
    from trainrun.checkpointing.reader import latest_state, saved_config

    _, state = latest_state(path, saved_config(path))
    have = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), state)
    want = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), abstract)
    # jaxlib ships no type for PyTreeDef, so mypy cannot see its comparison
    fits = jax.tree.structure(have) == jax.tree.structure(want)  # type: ignore[operator]
    if not fits or have != want:
        raise WeightsError(f"the state of {path} does not fit this run (another model, "
                           "optimizer or precision); use init.load=params for the params only")
    return jax.device_put(state, shardings)
