"""The run's configuration: a typed, frozen tree loaded from YAML (which may extend another
through ``base:``) plus ``key.path=value`` overrides. ``sections.py`` holds the sections,
``run.py`` the whole ``RunConfig`` and its one-line errors, ``files.py`` where each value comes
from. Validation is pydantic's (extra keys forbidden, types checked)."""

from trainrun.config.files import (
    CONFIG_PACKAGE,
    Layer,
    builtin_config_names,
    config_layers,
    load_config,
    merge,
    parse_overrides,
    resolve_config_path,
    show_config,
)
from trainrun.config.run import (
    ConfigError,
    RunConfig,
    config_from_dict,
    describe_validation_error,
    dump_yaml,
)
from trainrun.config.sections import (
    ArrayData,
    AutoDistributed,
    CheckpointConfig,
    CNNModel,
    ConstantSchedule,
    CosineSchedule,
    DataConfig,
    DigitsData,
    DistributedConfig,
    EvalConfig,
    ExplicitDistributed,
    ExponentialSchedule,
    LoraConfig,
    MeshConfig,
    MetricsConfig,
    MLPModel,
    ModelConfig,
    NNXMLPModel,
    OptimizerConfig,
    PiecewiseSchedule,
    PrecisionConfig,
    ProfileConfig,
    RegressionData,
    ScheduleConfig,
    Section,
    SingleProcess,
    TextData,
    TokenData,
    TransformerModel,
    WarmupSchedule,
    WSDSchedule,
)

__all__ = [
    "CONFIG_PACKAGE", "ArrayData", "AutoDistributed", "CNNModel", "CheckpointConfig",
    "ConfigError", "ConstantSchedule", "CosineSchedule", "DataConfig", "DigitsData",
    "DistributedConfig", "EvalConfig", "ExplicitDistributed", "ExponentialSchedule", "Layer",
    "LoraConfig",
    "MLPModel", "MeshConfig", "MetricsConfig", "ModelConfig", "NNXMLPModel", "OptimizerConfig",
    "PiecewiseSchedule", "PrecisionConfig", "ProfileConfig", "RegressionData", "RunConfig",
    "ScheduleConfig", "Section", "SingleProcess", "TextData", "TokenData", "TransformerModel",
    "WSDSchedule", "WarmupSchedule", "builtin_config_names", "config_from_dict",
    "config_layers", "describe_validation_error", "dump_yaml", "load_config", "merge",
    "parse_overrides", "resolve_config_path", "show_config",
]
