"""Each config concept said once: the synthetic data's seed follows the run's."""

from __future__ import annotations

import io

import numpy as np
import yaml

import trainrun
from trainrun import rundir
from trainrun.checkpointing.resume import check_config
from trainrun.cli import main
from trainrun.config import (
    RegressionData,
    RunConfig,
    config_from_dict,
    config_from_layers,
    load_config,
    saved_layers,
)
from trainrun.data.synthetic import regression_arrays
from trainrun.reporting.sinks.jsonl import read_metrics


def _losses(config: RunConfig, run_dir) -> list[float]:
    trainrun.run(config, run_dir, out=io.StringIO())
    return [row["loss"] for row in read_metrics(run_dir / rundir.METRICS)]


def test_the_run_seed_alone_changes_the_regression_data_and_init(tmp_path):
    default, seven = load_config("mlp", ["steps=2"]), load_config("mlp", ["steps=2", "seed=7"])
    assert default.data.seed == 1 and seven.data.seed == 8  # type: ignore[union-attr]
    assert not np.array_equal(regression_arrays(default.data)["x"],  # type: ignore[arg-type]
                              regression_arrays(seven.data)["x"])  # type: ignore[arg-type]
    # seed 7 with the default run's examples: only init differs; with its own: the data too
    init_only = load_config("mlp", ["steps=2", "seed=7", "data.seed=1"])
    assert init_only.data.seed == 1  # type: ignore[union-attr]
    losses = {name: _losses(config, tmp_path / name) for name, config in
              (("default", default), ("seven", seven), ("init_only", init_only))}
    assert losses["seven"] != losses["init_only"] != losses["default"]


def test_data_seed_still_overrides_the_run_seed():
    for raw in ({"seed": 7, "data": {"kind": "regression", "seed": 3}},
                {"seed": 7, "data": RegressionData(seed=3)}):
        assert RunConfig.model_validate(raw).data.seed == 3  # type: ignore[union-attr]
    assert RunConfig(seed=7).data.seed == 8  # type: ignore[union-attr]
    assert RunConfig(seed=2**32 - 1).data.seed == 0  # type: ignore[union-attr]


def test_the_default_run_is_bitwise_the_run_with_data_seed_1(tmp_path):
    reference = _losses(load_config("mlp", ["steps=5", "data.seed=1"]), tmp_path / "reference")
    assert _losses(load_config("mlp", ["steps=5"]), tmp_path / "default") == reference


def test_a_saved_config_with_data_seed_1_is_the_same_run(tmp_path):
    config = load_config("mlp")
    assert config.digest() == "bc4f2971a347709c"  # the digest before data.seed followed seed
    saved = config.to_dict()
    assert saved["data"]["seed"] == 1  # the resolved value is written, explicitly
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert config_from_layers(saved_layers(path)).digest() == config.digest()
    assert config_from_dict(saved).digest() == config.digest()
    assert check_config(saved, config, allow=False, where=tmp_path) == []


def test_config_show_names_the_run_seed_as_the_data_seed_origin(capsys):
    assert main(["config", "show", "--config", "mlp", "seed=3"]) == 0
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.startswith("  seed:")]
    assert [part.strip() for part in line.split("#")] == ["seed: 4", "seed + 1"]
