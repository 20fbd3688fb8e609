"""The whole run's configuration (``RunConfig``) and how it is checked: pydantic's validation,
the checks across sections, and pydantic's errors turned into one-line messages that name the
bad key and the fix. Where its values come from (files, bases, overrides) is ``files.py``."""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import pydantic
import yaml
from pydantic import BaseModel, Field

from trainrun.config import renamed
from trainrun.config.sections import (
    ARCHITECTURE,
    SAVED,
    SEED_MAX,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    InitConfig,
    MeshConfig,
    MetricsConfig,
    MLPModel,
    ModelConfig,
    NNXMLPModel,
    OptimizerConfig,
    PrecisionConfig,
    PreferenceConfig,
    ProfileConfig,
    RecordsData,
    RegressionData,
    RewardModelConfig,
    RLConfig,
    Section,
    SingleProcess,
    StorageConfig,
    TextData,
    TokenData,
    data_seed,
    names_a_model,
    schedule_steps,
    warmup_steps,
)
from trainrun.errors import UserError, printable


class ConfigError(UserError):
    """A configuration the user must fix; the CLI prints it on one line and exits 2."""


# ---- the run ---------------------------------------------------------------------------------


NAME_MAX = 255  # bytes in a file name on Linux's and macOS's file systems
LORA_PARAMS = r"_lora\.(a|b)$"  # the adapters' params: blocks.0.attn.q_lora.a, ...
SCORE_PARAM = r"^score$"  # a reward model's score head (models/reward_transformer.py)


# The four kinds of training run (``RunConfig.kind``): next-token or supervised training, DPO-style
# preference tuning, GRPO reinforcement learning, Bradley-Terry reward-model training.
RunKindName = Literal["language", "preference", "reinforcement", "reward"]
# the sections that tune a run into a kind of its own
TuningSection = typing.TypeVar("TuningSection", "PreferenceConfig", "RLConfig", "RewardModelConfig")


class RunConfig(Section):
    """The whole run's configuration: a frozen tree of sections, validated as it is made.

    Make one with ``load_config`` (a built-in name or a YAML file, its bases and overrides) or
    ``RunConfig.model_validate(dict)``; ``to_dict()`` gives it back as plain data, the form
    saved in the run directory and in each checkpoint."""

    # A plain file name: the run directory is runs/<name>; --run-dir is the way to pick a path.
    name: str = "run"
    seed: int = Field(default=0, ge=0, le=SEED_MAX)
    steps: int = Field(default=200, gt=0)
    steps_per_call: int = Field(default=1, gt=0)
    model: ModelConfig = Field(default_factory=MLPModel)
    data: DataConfig = Field(default_factory=RegressionData)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    accumulate: int = Field(default=1, gt=0)
    nonfinite: Literal["skip", "halt"] = "skip"
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    distributed: DistributedConfig = Field(default_factory=SingleProcess)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    # Preference tuning; None for the other runs, and then left out of the dumped config, so
    # their digests stay what they were.
    preference: PreferenceConfig | None = None
    # Reinforcement learning on prompt records; None for the other runs, left out as above.
    rl: RLConfig | None = None
    # A reward model trained on preference records; None for the other runs, left out as above.
    reward_model: RewardModelConfig | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, raw: Any) -> Any:
        return renamed.upgrade(raw, "the config") if isinstance(raw, dict) else raw

    @pydantic.model_validator(mode="before")
    @classmethod
    def _data_seeded_by_run(cls, raw: Any) -> Any:
        """Synthetic regression examples without ``data.seed`` are drawn from the run's seed
        (``data_seed``); the resolved config holds the value, so a saved run reads it back."""
        if not isinstance(raw, dict) or not seeds_data(raw):
            return raw
        seed, data = raw.get("seed", 0), raw.get("data")
        if isinstance(data, RegressionData):
            return {**raw, "data": data.model_copy(update={"seed": data_seed(seed)})}
        return {**raw, "data": {**(data or {"kind": "regression"}), "seed": data_seed(seed)}}

    @pydantic.model_validator(mode="before")
    @classmethod
    def _task_from_data(cls, raw: Any) -> Any:
        """An NNX MLP without ``model.task`` has its data's (``task_of_data``)."""
        task = task_of_data(raw) if isinstance(raw, dict) else None
        if task is None:
            return raw
        model = raw["model"]
        if isinstance(model, NNXMLPModel):
            return {**raw, "model": model.model_copy(update={"task": task})}
        return {**raw, "model": {**model, "task": task}}

    @pydantic.model_validator(mode="before")
    @classmethod
    def _model_sized_by_data(cls, raw: Any) -> Any:
        """A transformer's context and vocabulary not set in the config are its data's."""
        given = sized_by_data(raw) if isinstance(raw, dict) else {}
        if not given:
            return raw
        return {**raw, "model": {**raw["model"], **{key: value for key, (_, value)
                                                      in given.items()}}}

    @pydantic.model_validator(mode="before")
    @classmethod
    def _adapters_train_alone(cls, raw: Any) -> Any:
        """With ``model.lora`` and no ``optimizer.trainable``, only the adapters train (the
        resolved config says so, and a checkpoint's metadata records it)."""
        if not isinstance(raw, dict):
            return raw
        model, optimizer = raw.get("model"), raw.get("optimizer")
        if (isinstance(model, dict) and model.get("lora") is not None
                and (optimizer is None or isinstance(optimizer, dict))
                and (optimizer or {}).get("trainable") is None):
            # a reward model's score head is new: it trains beside the adapters, as PEFT's
            # sequence-classification task keeps its score module trained
            trained = [LORA_PARAMS, *([SCORE_PARAM] if raw.get("reward_model") is not None
                                      else [])]
            raw = {**raw, "optimizer": {**(optimizer or {}), "trainable": trained}}
        return raw

    @pydantic.field_validator("name")
    @classmethod
    def _plain_file_name(cls, value: str) -> str:
        if not value or value in (".", "..") or any(c in value for c in "/\\\0"):
            raise ValueError("a run name is a plain file name (runs/<name>): no '/', not empty, "
                             "not '.' or '..'; give --run-dir to choose a path")
        if not value.replace(" ", "").isprintable():
            raise ValueError(f"a run name holds control characters ({printable(value)}); give "
                             "letters, digits and punctuation")
        if len(value.encode()) > NAME_MAX:
            raise ValueError(f"a run name of {len(value.encode())} bytes is longer than a file "
                             f"name may be ({NAME_MAX}); give a shorter name")
        return value

    @pydantic.field_validator("distributed", mode="before")
    @classmethod
    def _distributed_shorthand(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value  # `distributed: auto`

    @pydantic.model_validator(mode="before")
    @classmethod
    def _pairs_tune_by_preference(cls, raw: Any) -> Any:
        """Preference records (``data.format: preference``) train under the ``preference``
        section's defaults when the config gives none (nor a ``reward_model`` section)."""
        if (not isinstance(raw, dict) or raw.get("preference") is not None
                or raw.get("reward_model") is not None):
            return raw
        data = raw.get("data")
        form = (data.get("format") if isinstance(data, dict) else getattr(data, "format", None))
        return {**raw, "preference": {}} if form == "preference" else raw

    @property
    def kind(self) -> RunKindName:
        """The kind of run this config describes, from the one section that tunes it (at most
        one is set: ``_check_rl`` and ``_check_reward_model`` refuse two): the one place that
        reads them to choose. ``training/kinds/`` holds what each kind does."""
        if self.preference is not None:
            return "preference"
        if self.rl is not None:
            return "reinforcement"
        if self.reward_model is not None:
            return "reward"
        return "language"

    def tuning(self, kind: type[TuningSection]) -> TuningSection:
        """The section of ``kind`` that tunes this run, for the code of that kind of run, which
        is handed only configs of its kind (``kind``): a config of another kind is a fault."""
        found = {PreferenceConfig: self.preference, RLConfig: self.rl,
                 RewardModelConfig: self.reward_model}[kind]
        if not isinstance(found, kind):
            raise TypeError(f"a {self.kind} run has no {kind.__name__} section")
        return found

    def to_dict(self) -> dict[str, Any]:
        dumped = self.model_dump(mode="json")
        for section in ("preference", "rl", "reward_model"):
            if dumped.get(section) is None:
                dumped.pop(section, None)
        return dumped

    def digest(self) -> str:
        """sha256 of the resolved config: names a trajectory in provenance and on resume.

        Placement (mesh, processes) is left out: the same run on another mesh or process count
        is the same trajectory, and a checkpoint restores across them. So are the metrics
        destinations and profiling, which change what is written, not what is computed."""
        trajectory = {k: v for k, v in self.to_dict().items()
                      if k not in ("mesh", "distributed", "metrics", "profile")}
        blob = json.dumps(trajectory, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---- keys that follow other keys -------------------------------------------------------------


def seeds_data(raw: dict[str, Any]) -> bool:
    """Whether a raw config leaves ``data.seed`` to the run's ``seed``: regression data (the
    default) that does not set it, and a valid run seed (else the seed's own error)."""
    seed, data = raw.get("seed", 0), raw.get("data")
    if type(seed) is not int or not 0 <= seed <= SEED_MAX:
        return False
    if isinstance(data, RegressionData):
        return "seed" not in data.model_fields_set
    return data is None or (isinstance(data, dict) and data.get("kind") == "regression"
                            and "seed" not in data)


Task = Literal["regression", "classification"]
# The loss an NNX MLP takes on each kind of data with a known target: digits has labels, the
# regression data targets ``y``.
TASK_OF_DATA: dict[str, Task] = {"regression": "regression", "digits": "classification"}
# The task where the data may hold either (user arrays): regression unless the config says.
DEFAULT_TASK: dict[str, Task] = {**TASK_OF_DATA, "arrays": "regression"}


def task_of_data(raw: dict[str, Any]) -> Task | None:
    """The ``model.task`` a raw config leaves to its data: an NNX MLP's that the config does
    not set, on data with a known task; None: the model's own (or not an NNX MLP)."""
    model, data = raw.get("model"), raw.get("data")
    if isinstance(model, NNXMLPModel):
        if "task" in model.model_fields_set:
            return None
    elif not (isinstance(model, dict) and model.get("kind") == "nnx_mlp" and "task" not in model):
        return None
    kind = (data.get("kind") if isinstance(data, dict)
            else "regression" if data is None else getattr(data, "kind", None))
    return DEFAULT_TASK.get(kind) if isinstance(kind, str) else None


def followed_keys(raw: dict[str, Any]) -> dict[tuple[str, ...], str]:
    """The keys a raw config leaves to other keys, ``{key path: what it follows}``, for
    ``config show`` to name as their origin."""
    follows: dict[tuple[str, ...], str] = {}
    if seeds_data(raw):
        follows[("data", "seed")] = "seed + 1"
    if task_of_data(raw) is not None:
        follows[("model", "task")] = "data.kind"
    byte_text = isinstance(raw.get("data"), dict) and raw["data"].get("kind") == "text"
    for key, (data_key, _) in sized_by_data(raw).items():
        follows[("model", key)] = ("data: byte-level text" if data_key == "tokenizer"
                                   and byte_text else f"data.{data_key}")
    for path in given_by_source(raw):
        follows[path] = "init.from"
    return follows


def model_source(raw: dict[str, Any]) -> str | None:
    """The ``init.from`` of a raw config where it names a model to start from (a run, a
    Hugging Face or adapter directory), not a bare ``.safetensors`` file, which names no
    architecture."""
    init = raw.get("init")
    source = init.get("from", init.get("from_")) if isinstance(init, dict) else None
    return source if isinstance(source, str) and names_a_model(source) else None


# What a model to start from gives a transformer run: its architecture (the context stays the
# run's choice, up to the model's) and, for records, their tokenizer and chat template.
SOURCE_KEYS = (*(("model", key) for key in ARCHITECTURE if key != "seq_len"),
               ("data", "tokenizer"), ("data", "chat_template"))


def source_keys(raw: dict[str, Any]) -> list[tuple[str, ...]]:
    """The keys of ``SOURCE_KEYS`` that the model a raw config starts from gives it (none
    without one): the model's of a transformer, the data's of records."""
    model, data = raw.get("model"), raw.get("data")
    if not (model_source(raw) and isinstance(model, dict) and model.get("kind") == "transformer"):
        return []
    records = isinstance(data, dict) and data.get("kind") == "records"
    return [path for path in SOURCE_KEYS if path[0] == "model" or records]


def given_by_source(raw: dict[str, Any]) -> list[tuple[str, ...]]:
    """The keys a raw config leaves to the model it starts from (``init.from``, a run or a
    model directory: ``checkpointing/init_from.py`` reads them there): ``source_keys`` that
    the config does not set."""
    return [(section, key) for section, key in source_keys(raw) if key not in raw[section]]


# ---- what the data gives the model -----------------------------------------------------------


TOKEN_DATA: dict[str, type[TextData | TokenData | RecordsData]] = {
    "text": TextData, "tokens": TokenData, "records": RecordsData}
BYTES = 256  # the vocabulary of byte-level text
# records' ``bytes`` tokenizer: the 256 bytes, <|endoftext|>, <|im_start|> and <|im_end|>
BYTE_TOKENIZER = BYTES + 3


def sized_by_data(raw: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """The transformer keys a raw config leaves to its data: ``{model key: (data key, value)}``.

    The model's context (``model.seq_len``) is the data's rows (``data.seq_len``); the
    vocabulary of text data (``model.vocab``) is its tokenizer's (``data.vocab_size``), or the
    256 bytes without one; that of records is their tokenizer's size (``records_vocab``:
    ``bytes``, the 256 bytes and its special tokens; a local Hugging Face tokenizer, its ids,
    added tokens included). A key the config sets is its own; with ``init.from`` the source
    gives the model (``checkpointing/init_from.py``). A records tokenizer not known here (on
    object storage, missing, unreadable) leaves ``model.vocab`` to its default: the run reads
    it and refuses a ``model.vocab`` below its size, or names why it cannot read it."""
    model, data, init = raw.get("model"), raw.get("data"), raw.get("init")
    if not (isinstance(model, dict) and model.get("kind") == "transformer"
            and isinstance(data, dict) and data.get("kind") in TOKEN_DATA):
        return {}
    if isinstance(init, dict) and (init.get("from") or init.get("from_")) is not None:
        return {}
    section = TOKEN_DATA[data["kind"]]
    given: dict[str, tuple[str, int]] = {}

    def take(model_key: str, data_key: str, default: Any) -> None:
        value = data.get(data_key, default)
        if model_key not in model and type(value) is int and value > 0:  # else the data's error
            given[model_key] = (data_key, value)

    take("seq_len", "seq_len", section.model_fields["seq_len"].default)
    if data["kind"] == "text" and data.get("tokenizer") is not None:
        take("vocab", "vocab_size", TextData.model_fields["vocab_size"].default)
    elif data["kind"] == "text" and "vocab" not in model:
        given["vocab"] = ("tokenizer", BYTES)
    elif data["kind"] == "records" and "vocab" not in model:
        tokenizer = data.get("tokenizer")
        size = records_vocab(tokenizer) if tokenizer is None or isinstance(tokenizer, str) else None
        if size is not None:
            given["vocab"] = ("tokenizer", size)
    return given


def records_vocab(tokenizer: str | None) -> int | None:
    """The size of the tokenizer records are read with (``data.tokenizer``; None: ``bytes``):
    ids, added tokens included. None where it is not known before the data layer reads it: a
    tokenizer on object storage, or one missing or unreadable (the run then names why)."""
    if tokenizer is None or tokenizer == "bytes":
        return BYTE_TOKENIZER
    if "://" in tokenizer:
        return None
    path = Path(tokenizer).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        return None
    # a file written anew under the same name is read anew
    return _tokenizer_size(str(file), file.stat().st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _tokenizer_size(file: str, stamp: int) -> int | None:
    try:
        import tokenizers
    except ImportError:  # the data's own error says to install it
        return None
    try:
        return int(tokenizers.Tokenizer.from_file(file).get_vocab_size(with_added_tokens=True))
    except Exception:  # the library raises a bare Exception for bad JSON; the data names it
        return None


# ---- validation ------------------------------------------------------------------------------


def config_from_dict(raw: dict[str, Any], source: str | None = "the config") -> RunConfig:
    """The validated config of ``raw``; ``source`` names it in the warning of a key given by
    its old name (None: a config trainrun wrote, read back: its old names are read silently,
    and the metric sinks its run wrote to need not be installed here)."""
    try:
        raw = renamed.upgrade(raw, source)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        config = RunConfig.model_validate(raw, context={SAVED: source is None})
    except pydantic.ValidationError as err:
        raise ConfigError(describe_validation_error(err, raw)) from None
    _check_optimization(config)
    _check_model_and_data(config)
    return config


def _check_optimization(config: RunConfig) -> None:
    """Keys that are each valid but do not fit together (accumulation, schedule, precision)."""
    batch = config.data.batch_size
    if batch % config.accumulate:
        raise ConfigError(f"accumulate={config.accumulate} does not divide data.batch_size="
                          f"{batch}; pick an accumulate that divides the batch")
    if config.nonfinite == "halt" and config.precision.compute == "float16":
        raise ConfigError("nonfinite=halt cannot be used with precision.compute=float16: its loss "
                          "scaling skips overflowing steps by design; use nonfinite=skip")
    sched = config.optimizer.schedule
    total = schedule_steps(sched, config.steps)
    warmup = warmup_steps(sched, total)
    given = f"optimizer.schedule.warmup={getattr(sched, 'warmup', 0)}" + (
        f" ({warmup} steps)" if isinstance(getattr(sched, "warmup", 0), float) else "")
    if sched.kind == "cosine" and warmup >= total:
        raise ConfigError(f"{given} leaves no steps to decay in {total} total steps; give a "
                          "shorter warm-up, e.g. optimizer.schedule.warmup=0.1 (a tenth of the "
                          "run)")
    if sched.kind == "wsd" and warmup + round(sched.decay_fraction * total) > total:
        raise ConfigError(f"{given} plus optimizer.schedule.decay_fraction="
                          f"{sched.decay_fraction} of {total} steps exceeds the total; lower one")


def schedule_notices(config: RunConfig) -> list[str]:
    """Lines a run prints about a warm-up that is not what its key seems to ask: a fraction of
    a short run that rounds to no step, or a warm-up as long as the whole run."""
    sched = config.optimizer.schedule
    warmup = getattr(sched, "warmup", 0)
    total = schedule_steps(sched, config.steps)
    steps = warmup_steps(sched, total)
    if isinstance(warmup, float) and warmup > 0 and steps == 0:
        return [f"optimizer.schedule.warmup={warmup} of {total} step{'s' * (total > 1)} is "
                "less than half a step: this run has no warm-up"]
    if sched.kind in ("warmup", "exponential") and steps >= config.steps:
        return [f"optimizer.schedule.warmup={warmup} ({steps} steps) lasts the whole run of "
                f"{config.steps} steps: the learning rate never reaches optimizer.lr="
                f"{config.optimizer.lr}; give a shorter warm-up, e.g. 0.1 (a tenth of the run)"]
    return []


def _check_model_and_data(config: RunConfig) -> None:
    """Model and data keys that are each valid but do not fit together."""
    model, data = config.model, config.data
    if model.kind == "transformer":
        if data.kind in ("regression", "digits"):
            raise ConfigError(f"model.kind=transformer needs token data, not data.kind="
                              f"{data.kind}; use data.kind=text, tokens or records")
        # the context of a model to start from is its own: init_from.py checks it there
        sourced = config.init.model_source is not None and "seq_len" not in (
            model.model_fields_set)
        if (isinstance(data, (TextData, TokenData, RecordsData)) and not sourced
                and data.seq_len > model.seq_len):
            raise ConfigError(f"data.seq_len={data.seq_len} is longer than the model's context "
                              f"model.seq_len={model.seq_len}; drop model.seq_len (it follows "
                              f"data.seq_len) or raise it to at least {data.seq_len}")
        if data.kind == "text" and data.tokenizer is None and model.vocab < BYTES:
            raise ConfigError(f"byte-level text needs model.vocab >= {BYTES}, got {model.vocab}; "
                              "drop model.vocab (it follows the data)")
        if data.kind == "text" and data.tokenizer is not None and model.vocab < data.vocab_size:
            raise ConfigError(f"model.vocab={model.vocab} is smaller than the tokenizer's "
                              f"data.vocab_size={data.vocab_size}; drop model.vocab (it follows "
                              "data.vocab_size) or set it to at least that")
    if (model.kind == "nnx_mlp" and data.kind in TASK_OF_DATA
            and model.task != TASK_OF_DATA[data.kind]):
        target = "label" if model.task == "classification" else "y"
        raise ConfigError(f"model.task={model.task} needs '{target}' targets, which data.kind="
                          f"{data.kind} does not have; drop model.task (it follows the data: "
                          f"{TASK_OF_DATA[data.kind]})")
    _check_preference(config)
    _check_rl(config)
    _check_reward_model(config)
    if config.eval.params == "ema" and config.optimizer.ema is None:
        raise ConfigError("eval.params=ema needs a moving average to evaluate: set "
                          "optimizer.ema (e.g. 0.999)")
    if config.eval.every and data.kind == "regression":
        raise ConfigError("eval.every is set but data.kind=regression has no held-out split; "
                          "set eval.every=0 or use data with one (digits, text, arrays, tokens)")
    if config.eval.generate and (data.kind != "records" or model.kind != "transformer"
                                 or not config.eval.every):
        raise ConfigError(f"eval.generate={config.eval.generate} generates held-out answers of "
                          "a transformer on chat or completion records at each evaluation: it "
                          "needs model.kind=transformer, data.kind=records and eval.every > 0 "
                          "(or set eval.generate=0)")


def _check_preference(config: RunConfig) -> None:
    """A ``preference`` section trains a transformer on preference records, and only there."""
    if config.preference is None:
        return
    data = config.data
    if not isinstance(data, RecordsData) or data.format != "preference":
        shown = f"data.format={data.format}" if isinstance(data, RecordsData) else (
            f"data.kind={data.kind}")
        raise ConfigError(f"the preference section trains on preference records, not {shown}; "
                          "set data.kind=records and data.format=preference, or drop the "
                          "preference section")
    if config.model.kind != "transformer":
        raise ConfigError(f"preference tuning trains a transformer, not model.kind="
                          f"{config.model.kind}; set model.kind=transformer")
    if data.mix:
        raise ConfigError("data.format=preference reads data.paths or data.synthetic, not "
                          "data.mix; list the files in data.paths")
    if config.eval.generate:
        raise ConfigError(f"eval.generate={config.eval.generate} scores generated answers of "
                          "chat or completion records, not preference pairs; set "
                          "eval.generate=0 (evaluation reports reward accuracy and margins)")


def _check_rl(config: RunConfig) -> None:
    """An ``rl`` section trains a transformer on prompt records, one rollout batch per call of
    ``rl.updates`` steps, so every step a hook stops at starts a rollout batch."""
    rl = config.rl
    if rl is None:
        return
    data = config.data
    if not isinstance(data, RecordsData) or data.format == "preference" or data.mix:
        shown = f"data.kind={data.kind}" if not isinstance(data, RecordsData) else (
            "data.mix" if data.mix else "data.format=preference")
        raise ConfigError(f"the rl section draws completions of prompt records, not {shown}; "
                          "set data.kind=records with data.paths or data.synthetic, or drop the "
                          "rl section")
    if config.model.kind != "transformer":
        raise ConfigError(f"rl trains a transformer, not model.kind={config.model.kind}; set "
                          "model.kind=transformer")
    if config.preference is not None:
        raise ConfigError("a run tunes by preference pairs or by rewards, not both; drop the "
                          "preference or the rl section")
    if config.steps_per_call != rl.updates:
        raise ConfigError(f"steps_per_call={config.steps_per_call}: an rl call draws one rollout "
                          f"batch and takes rl.updates={rl.updates} steps on it; set "
                          f"steps_per_call={rl.updates}")
    every = {"steps": config.steps, "checkpoint.every": config.checkpoint.every,
             "metrics.every": config.metrics.every, "eval.every": config.eval.every}
    for name, value in every.items():
        if value % rl.updates:
            raise ConfigError(f"{name}={value} is not a multiple of rl.updates={rl.updates}: a "
                              "run stops only between rollout batches; give a multiple")


def _check_reward_model(config: RunConfig) -> None:
    """A ``reward_model`` section trains a transformer's score head on preference records, and
    is no other kind of run."""
    if config.reward_model is None:
        return
    data = config.data
    if not isinstance(data, RecordsData) or data.format != "preference":
        shown = f"data.format={data.format}" if isinstance(data, RecordsData) else (
            f"data.kind={data.kind}")
        raise ConfigError(f"the reward_model section trains on preference records, not "
                          f"{shown}; set data.kind=records and data.format=preference, or drop "
                          "the reward_model section")
    if config.model.kind != "transformer":
        raise ConfigError(f"a reward model is a transformer, not model.kind="
                          f"{config.model.kind}; set model.kind=transformer")
    for other in ("preference", "rl"):
        if getattr(config, other) is not None:
            raise ConfigError(f"a run trains a reward model or tunes by {other}, not both; "
                              f"drop the reward_model or the {other} section")
    if data.mix:
        raise ConfigError("data.format=preference reads data.paths or data.synthetic, not "
                          "data.mix; list the files in data.paths")
    if config.eval.generate:
        raise ConfigError(f"eval.generate={config.eval.generate} scores generated answers, "
                          "and a reward model generates none; set eval.generate=0 (evaluation "
                          "reports the accuracy on held-out pairs)")


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


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The section an annotation holds alone (``X``, ``X | None``, a sequence of ``X``)."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [a for a in typing.get_args(annotation) if a is not type(None) and a is not ...]
    if len(members) == 1 and typing.get_origin(annotation) in (Union, types.UnionType, tuple,
                                                               list):
        return _section_of(members[0])
    return None


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
        field = cls.model_fields.get(str(part)) or next(  # a key spelled by its alias
            (f for f in cls.model_fields.values() if f.alias == str(part)), None)
        path.append(str(part))
        if field is None:
            return path, cls, None
        annotation = field.annotation
        members = _union_members(annotation)
        if members is not None and items and items[0] in members:
            cls = members[items.pop(0)]
            continue
        sequence = typing.get_origin(annotation) in (tuple, list)
        if sequence and items and isinstance(items[0], int):  # an item of a list of sections
            path.append(str(items.pop(0)))
        cls = _section_of(annotation) if (items or not sequence) else None
        if cls is not None and items:
            annotation = cls
    return path, cls, annotation


# What a config key's type is called in a message: the YAML a user writes, not Python's names.
PLAIN = {int: "int", float: "float", bool: "bool (true or false)", str: "str",
         type(None): "null"}


def _type_name(annotation: Any) -> str:
    if annotation is None:
        return "a value"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in PLAIN:
        return PLAIN[annotation]
    if origin is Annotated:  # bounds are said by pydantic's message
        return _type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return "a list of mappings of keys" if _section_of(args[0]) else (
            f"list[{_type_name(args[0])}]")
    if origin is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        members = _union_members(annotation)
        if members is not None and len(members) > 1:  # a section chosen by its kind
            return f"a mapping of keys with kind: {_or(list(members))}"
        return _or([_type_name(a) for a in args])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping of keys"
    return str(annotation).replace("typing.", "")


def _or(names: list[str]) -> str:
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


# pydantic's errors that say only what the key's type already says ("a valid dictionary or
# instance of PreferenceConfig"): left out of the message
TYPE_ONLY = {"model_type", "model_attributes_type", "dict_type", "tuple_type", "list_type"}


def describe_validation_error(err: pydantic.ValidationError, raw: dict[str, Any]) -> str:
    """The first problem of a pydantic error, as one line that names the key and the fix."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    path, cls, annotation = _walk(loc)
    dotted = ".".join(path)
    kind = first["type"]
    if kind == "extra_forbidden" and cls is not None:
        valid = [f.alias or name for name, f in cls.model_fields.items()]
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
    if kind == "value_error":  # a section's own check; its message names the fix
        return f"config key {dotted!r}: {first['msg'].removeprefix('Value error, ')}"
    if kind == "missing":
        return f"config key {dotted!r} is required; give it a value ({_type_name(annotation)})"
    given = first.get("input")
    expected = _type_name(annotation)
    said = "" if kind in TYPE_ONLY else f": {first['msg']}"
    return f"config key {dotted!r} expects {expected}, got {given!r} ({_given(given)}){said}"


def _given(value: Any) -> str:
    """What a value read from YAML is, in YAML's words."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return PLAIN.get(type(value), type(value).__name__).split(" ")[0]


def dump_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
