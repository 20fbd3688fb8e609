"""Each config concept said once: the synthetic data's seed follows the run's; the held-out
files of arrays and tokens are ``data.eval_paths`` (not ``data.eval``, beside the top-level
``eval`` cadence) and their training files ``data.paths``, as for text and records; a records
run's synthetic chat task is ``data.synthetic`` and an NNX MLP's ``model.task`` (its loss)
follows the data, and a records run's transformer has its tokenizer's vocabulary."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import trainrun
from trainrun import rundir
from trainrun.checkpointing.resume import check_config
from trainrun.cli import main
from trainrun.config import (
    ConfigError,
    NNXMLPModel,
    RecordsData,
    RegressionData,
    RunConfig,
    TokenData,
    config_from_dict,
    config_from_layers,
    load_config,
    renamed,
    saved_layers,
)
from trainrun.data import DataError, build_eval_dataset
from trainrun.data.synthetic import regression_arrays
from trainrun.reporting.sinks.jsonl import read_metrics


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(renamed, "_warned", set())  # each test sees its first warnings


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


def _arrays(tmp_path) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    for name, rows in (("train", 64), ("held", 16)):
        x = rng.normal(size=(rows, 8)).astype(np.float32)
        np.savez(tmp_path / f"{name}.npz", x=x, y=x.sum(1, keepdims=True))
    return str(tmp_path / "train.npz"), str(tmp_path / "held.npz")


def test_array_files_are_paths_and_eval_paths_and_evaluate(tmp_path):
    train, held = _arrays(tmp_path)
    config = load_config("mlp", ["steps=2", "data.kind=arrays", f"data.paths={train}",
                                 f"data.eval_paths={held}", "data.batch_size=16",
                                 "eval.every=1"])
    assert config.data.paths == train and config.data.eval_paths == held  # type: ignore[union-attr]
    trainrun.run(config, tmp_path / "run", out=io.StringIO())
    held_out = read_metrics(tmp_path / "run" / rundir.METRICS, split="eval")
    assert [row["step"] for row in held_out] == [1, 2] and all("loss" in r for r in held_out)


@pytest.mark.parametrize("kind", ["arrays", "tokens"])
def test_old_names_of_the_data_files_load_as_the_new_with_one_warning(tmp_path, kind):
    with pytest.warns(renamed.RenamedKeyWarning) as said:
        config = load_config("mlp", [f"data.kind={kind}", "data.train=a", "data.eval=b"])
    assert config.data.paths == "a" and config.data.eval_paths == "b"  # type: ignore[union-attr]
    assert [str(w.message).split(";")[0] for w in said] == [
        "config key data.train is now data.paths", "config key data.eval is now data.eval_paths"]


def test_a_saved_run_with_the_old_data_file_names_resumes_silently(tmp_path, recwarn):
    train, held = _arrays(tmp_path)
    config = load_config("mlp", ["data.kind=arrays", f"data.paths={train}",
                                 f"data.eval_paths={held}"])
    old = config.to_dict()
    old["data"]["train"], old["data"]["eval"] = (old["data"].pop("paths"),
                                                 old["data"].pop("eval_paths"))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    assert config_from_layers(saved_layers(path)) == config
    assert check_config(old, config, allow=False, where=tmp_path) == []
    assert not [w for w in recwarn if issubclass(w.category, renamed.RenamedKeyWarning)]


def test_both_names_of_the_held_out_files_is_one_line_error():
    with pytest.raises(ConfigError, match=r"data\.eval and data\.eval_paths are both given in "
                       r"the overrides; keep data\.eval_paths alone"):
        load_config("mlp", ["data.kind=tokens", "data.eval=a.bin", "data.eval_paths=b.bin"])


def test_token_data_without_held_out_files_names_eval_paths(tmp_path):
    (tmp_path / "t.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match=r"give data\.eval_paths \(a held-out \.bin file\)"):
        build_eval_dataset(TokenData(paths=str(tmp_path / "t.bin"), seq_len=8))


def test_the_records_synthetic_task_is_data_synthetic_and_old_names_warn():
    config = load_config("chat")
    assert config.data.synthetic == "reverse"  # type: ignore[union-attr]
    assert config.data.synthetic_examples == 8192  # type: ignore[union-attr]
    with pytest.warns(renamed.RenamedKeyWarning) as said:
        old = load_config("chat", ["data.task=add", "data.task_examples=64"])
    assert old.data.synthetic == "add" and old.data.synthetic_examples == 64  # type: ignore
    assert [str(w.message).split(";")[0] for w in said] == [
        "config key data.task is now data.synthetic",
        "config key data.task_examples is now data.synthetic_examples"]
    saved = config.to_dict()
    saved["data"]["task"] = saved["data"].pop("synthetic")
    saved["data"]["task_examples"] = saved["data"].pop("synthetic_examples")
    assert check_config(saved, config, allow=False, where=Path("runs/chat")) == []
    with pytest.raises(ConfigError, match=r"give one of data\.paths .* or data\.synthetic "
                       r"\(reverse, add, letter, last\); got data\.paths and data\.synthetic"):
        load_config("chat", ["data.paths=a.jsonl", "data.synthetic=add"])  # one layer: both


@pytest.mark.parametrize(("data", "task"), [("regression", "regression"),
                                            ("digits", "classification"),
                                            ("arrays", "regression")])
def test_the_nnx_mlp_task_follows_the_data(data, task):
    config = load_config("mlp", ["model.kind=nnx_mlp", f"data.kind={data}"])
    assert config.model.task == task  # type: ignore[union-attr]
    given = load_config("mlp", ["model.kind=nnx_mlp", f"data.kind={data}",
                                f"model.task={task}"])
    assert given == config and given.digest() == config.digest()
    assert RunConfig(model=NNXMLPModel(), data={"kind": data}).model.task == task  # type: ignore


def test_the_nnx_mlp_trains_on_digits_without_model_task(tmp_path):
    overrides = ["steps=2", "model.kind=nnx_mlp", "model.features=64", "model.outputs=10",
                 "data.kind=digits"]
    losses = _losses(load_config("mlp", overrides), tmp_path / "followed")
    given = load_config("mlp", [*overrides, "model.task=classification"])
    assert losses == _losses(given, tmp_path / "given")
    rows = read_metrics(tmp_path / "followed" / rundir.METRICS)
    assert "accuracy" in rows[-1]  # classification's metric


def test_arrays_with_labels_still_take_model_task_classification():
    config = load_config("mlp", ["model.kind=nnx_mlp", "data.kind=arrays",
                                 "model.task=classification"])
    assert config.model.task == "classification"  # type: ignore[union-attr]


@pytest.mark.parametrize(("data", "task", "target"), [("digits", "regression", "'y'"),
                                                      ("regression", "classification", "'label'")])
def test_a_task_the_data_has_no_targets_for_is_one_line(data, task, target):
    with pytest.raises(ConfigError) as err:
        load_config("mlp", ["model.kind=nnx_mlp", f"data.kind={data}", f"model.task={task}"])
    assert str(err.value) == (f"model.task={task} needs {target} targets, which data.kind={data} "
                              f"does not have; drop model.task (it follows the data: "
                              f"{'classification' if data == 'digits' else 'regression'})")


def _records(**data: Any) -> dict[str, Any]:
    return {"steps": 2, "model": {"kind": "transformer", "d_model": 32, "layers": 1, "heads": 2},
            "data": {"kind": "records", "synthetic": "reverse", "synthetic_examples": 64,
                     "seq_len": 32, "batch_size": 8, **data}}


def test_records_without_model_vocab_train_with_the_tokenizers_embedding(tmp_path):
    config = config_from_dict(_records())
    assert (config.model.vocab, config.model.seq_len) == (259, 32)  # type: ignore[union-attr]
    trainrun.run(config, tmp_path / "run", out=io.StringIO())
    model = trainrun.load(tmp_path / "run")
    assert model.config.vocab == 259
    assert model.logits([[1, 2, 3]]).shape == (1, 3, 259)  # an embedding row per token id
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["model"]["vocab"] == 259


def test_records_vocab_is_a_hugging_face_tokenizers_size_unless_set(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(300)} | {"<unk>": 300}, unk_token="<unk>"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    given = _records(tokenizer=str(tmp_path / "tokenizer.json"))
    assert config_from_dict(given).model.vocab == 302  # type: ignore[union-attr]
    given["model"]["vocab"] = 512
    assert config_from_dict(given).model.vocab == 512  # type: ignore[union-attr]


def test_config_show_names_the_records_tokenizer_as_the_vocab_origin(tmp_path, capsys):
    path = tmp_path / "records.yaml"
    path.write_text(yaml.safe_dump(_records()))
    assert main(["config", "show", "--config", str(path)]) == 0
    shown = capsys.readouterr().out.splitlines()
    (line,) = [row for row in shown if row.startswith("  vocab:")]
    assert [part.strip() for part in line.split("#")] == ["vocab: 259", "data.tokenizer"]


def test_an_unreadable_records_tokenizer_is_the_datas_error_not_the_configs(tmp_path):
    config = config_from_dict(_records(tokenizer=str(tmp_path / "missing")))
    assert config.model.vocab == 256  # the default: the run names the missing tokenizer
    with pytest.raises(DataError, match=r"data\.tokenizer .*missing.* not found"):
        trainrun.run(config, tmp_path / "run", out=io.StringIO())


def test_old_data_names_through_the_python_api():
    with pytest.warns(renamed.RenamedKeyWarning, match="data.paths"):
        assert TokenData(train="t.bin").paths == "t.bin"  # type: ignore[call-arg]
    with pytest.warns(renamed.RenamedKeyWarning, match="data.synthetic"):
        assert RecordsData(task="add").synthetic == "add"  # type: ignore[call-arg]


def test_the_configs_byte_tokenizer_size_is_the_data_layers():
    from trainrun.config.run import BYTE_TOKENIZER
    from trainrun.data.model_tokenizer import byte_tokenizer

    assert byte_tokenizer().size == BYTE_TOKENIZER == 259
