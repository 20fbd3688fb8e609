"""Where a config comes from: built-in names against local paths, ``base:`` chains and their
merge order, and ``trainrun config show``'s origins."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from trainrun.cli import build_parser, main
from trainrun.config import ConfigError, load_config, show_config


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def origins(text: str) -> dict[str, str]:
    """``config show`` text -> {dotted key: origin}."""
    out: dict[str, str] = {}
    parents: list[str] = []
    for line in text.splitlines():
        depth = (len(line) - len(line.lstrip())) // 2
        key = line.strip().split(":", 1)[0]
        parents[depth:] = [key]
        if "#" in line:
            out[".".join(parents)] = line.split("# ", 1)[1]
    return out


# ---- built-in names and paths ----------------------------------------------------------------


def test_builtin_name_wins_over_a_folder_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "digits").mkdir()
    (tmp_path / "mlp").write_text("steps: 3\n")  # a file too: the bare name is the built-in
    monkeypatch.chdir(tmp_path)
    assert load_config("digits").model.kind == "cnn"
    assert load_config("mlp").steps == 200
    assert load_config("./mlp").steps == 3  # the local file, written as a path


@pytest.mark.slow
def test_train_with_a_builtin_name_next_to_a_folder_of_that_name(tmp_path, cli):
    (tmp_path / "mlp").mkdir()
    result = cli("train", "--config", "mlp", "--run-dir", str(tmp_path / "r"), "steps=2",
                 "checkpoint.every=0", "metrics.tensorboard=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "r" / "summary.json").is_file()


@pytest.mark.parametrize("command", ["train", "config"])
def test_a_folder_as_config_is_one_line_exit_2(tmp_path, capsys, command):
    (tmp_path / "exp").mkdir()
    argv = ["train", "--run-dir", str(tmp_path / "r")] if command == "train" else [
        "config", "show"]
    assert main([*argv, "--config", str(tmp_path / "exp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a folder, not a YAML file" in err[0], err
    assert not (tmp_path / "r").exists()


def test_options_may_come_before_between_or_after_the_overrides(capsys):
    """``trainrun launch`` appends its overrides after the user's options; a user may write
    them in any order too. Before, an override after an option was "unrecognized"."""
    assert main(["config", "show", "steps=7", "--config", "mlp", "metrics.every=3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert (shown["steps"], shown["metrics"]["every"], shown["model"]["kind"]) == (7, 3, "mlp")
    train = build_parser().parse_args(["train", "steps=2", "--run-dir", "r", "metrics.every=1",
                                       "--config", "lm", "--fresh", "seed=3"])
    assert (train.overrides, train.run_dir, train.config, train.fresh) == (
        ["steps=2", "metrics.every=1", "seed=3"], "r", "lm", True)
    verify = build_parser().parse_args(["verify-resume", "steps=4", "--kill-at", "2", "seed=1"])
    assert (verify.overrides, verify.kill_at) == (["steps=4", "seed=1"], [2])


# ---- base: chains ----------------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """child.yaml -> ../common.yaml -> the built-in mlp: three layers over the defaults."""
    write(tmp_path / "common.yaml", """\
        base: mlp
        steps: 50
        model:
          hidden: [64, 64]
        optimizer:
          lr: 0.05
          clip_norm: 2.0
        """)
    return write(tmp_path / "exp" / "child.yaml", """\
        base: ../common.yaml
        model:
          hidden: [8]
        optimizer:
          clip_norm: 1.0
          b1: 0.8
        """)


def test_base_chain_merges_nested_keys_and_replaces_lists(chain):
    config = load_config(str(chain), ["optimizer.b1=0.7"])
    assert config.model.hidden == [8]  # the list replaced, not merged item by item
    assert config.model.features == 8  # model keys of mlp, two bases down, kept
    assert config.optimizer.lr == 0.05  # common's key beside the child's own optimizer keys
    assert config.optimizer.clip_norm == 1.0  # file over base
    assert config.optimizer.b1 == 0.7  # override over file
    assert config.optimizer.name == "adam" and config.steps == 50  # mlp's, common's
    assert config.eval.every == 0  # set by no file: the default


def test_config_show_names_each_values_origin(chain, capsys):
    assert main(["config", "show", "--config", str(chain), "optimizer.b1=0.7"]) == 0
    text = capsys.readouterr().out
    found = origins(text)
    child, common = str(chain), str(chain.parent.parent / "common.yaml")
    assert found["optimizer.b1"] == "override"
    assert found["optimizer.clip_norm"] == f"file: {child}"
    assert found["model.hidden"] == f"file: {child}"
    assert found["optimizer.lr"] == f"base: {common}"
    assert found["steps"] == f"base: {common}"
    assert found["model.features"] == "base: mlp (built-in)"
    assert found["eval.every"] == "default"
    # The origins are comments: the text is the resolved config as YAML.
    assert yaml.safe_load(text) == load_config(str(chain), ["optimizer.b1=0.7"]).to_dict()


@pytest.mark.slow
def test_config_show_through_the_command_line(tmp_path, cli):
    (tmp_path / "digits").mkdir()
    result = cli("config", "show", "--config", "digits", "steps=300", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found = origins(result.stdout)
    assert found["model.kind"] == "file: digits (built-in)"
    assert found["steps"] == "override"
    assert found["checkpoint.keep"] == "default"


def test_a_section_of_another_kind_replaces_the_bases(tmp_path):
    child = write(tmp_path / "mine.yaml", """\
        base: lm
        data: {kind: tokens, paths: train.bin}
        model: {layers: 1}
        """)
    config = load_config(str(child))
    assert config.data.kind == "tokens" and config.data.paths == "train.bin"
    assert config.data.batch_size == 32  # token data's default, not lm's 16 for its text
    assert config.model.layers == 1 and config.model.d_model == 128  # same kind: merged
    found = origins(show_config(str(child), ["data.kind=text"]))
    assert found["data.kind"] == "override"
    assert found["data.batch_size"] == found["data.eval_fraction"] == "default"


def test_a_shorthand_replaces_the_section_below_it(tmp_path):
    write(tmp_path / "base.yaml", "base: mlp\ndistributed: {kind: explicit, peer_timeout_s: 5}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ndistributed: auto\n")
    assert load_config(str(child)).distributed.peer_timeout_s == 20
    found = origins(show_config(str(child)))
    assert found["distributed.kind"] == f"file: {child}"
    assert found["distributed.peer_timeout_s"] == "default"  # not base.yaml's 5


@pytest.mark.parametrize("files", [
    {"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"},
    {"a.yaml": "base: a.yaml\n"},
])
def test_base_cycle_is_refused_naming_the_cycle(tmp_path, files):
    for name, text in files.items():
        write(tmp_path / name, text)
    names = [*files, "a.yaml"]
    with pytest.raises(ConfigError) as err:
        load_config(str(tmp_path / "a.yaml"))
    message = str(err.value)
    assert message.startswith("config base cycle: ")
    assert " -> ".join(str(tmp_path / n) for n in names) in message


def test_missing_base_is_one_line_exit_2(tmp_path, capsys):
    top = write(tmp_path / "top.yaml", "base: nope.yaml\nsteps: 3\n")
    assert main(["train", "--config", str(top), "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"config {top}: base 'nope.yaml'" in err[0] and "not found" in err[0]
    assert not (tmp_path / "r").exists()


def test_base_must_be_a_name_or_path(tmp_path):
    top = write(tmp_path / "top.yaml", "base: [mlp]\n")
    with pytest.raises(ConfigError, match=r"base must be a built-in name or a path"):
        load_config(str(top))
