"""Keys a run gives once: the schedule's length and warm-up follow ``steps``; keys with a new name
(``log_every`` -> ``metrics.every``, ``warmup_steps`` -> ``warmup``) still load under the old one
with one warning line each."""

from __future__ import annotations

import io

import pytest
import yaml

import trainrun
from trainrun import rundir
from trainrun.checkpointing.resume import ConfigChangedError, check_config
from trainrun.cli import main
from trainrun.config import (
    ConfigError,
    OptimizerConfig,
    RunConfig,
    builtin_config_names,
    config_from_layers,
    load_config,
    renamed,
    saved_layers,
    schedule_notices,
    schedule_steps,
    warmup_steps,
)
from trainrun.reporting.sinks.jsonl import read_metrics

# The warm-up each built-in run had in steps before it was a fraction: unchanged at its steps.
BUILTIN_WARMUP = {"lm": 50, "lm_bpe": 50, "digits": 100, "digits_resnet": 100, "chat": 100,
                  "finetune": 20, "mlp": 0, "dpo": 30, "grpo": 0, "reward": 20}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(renamed, "_warned", set())  # each test sees its first warnings


def test_builtin_warmups_are_the_steps_they_were():
    assert set(BUILTIN_WARMUP) == set(builtin_config_names())
    for name, steps in BUILTIN_WARMUP.items():
        config = load_config(name)
        assert warmup_steps(config.optimizer.schedule, config.steps) == steps, name


@pytest.mark.parametrize("name", sorted(BUILTIN_WARMUP))
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 20, 37, 5000])
def test_steps_alone_fits_every_builtin_config(name, steps):
    config = load_config(name, [f"steps={steps}"])
    schedule = config.optimizer.schedule
    total = schedule_steps(schedule, config.steps)
    warmup = warmup_steps(schedule, total)
    assert total == steps
    assert warmup < steps or warmup == 0  # some steps are left to decay
    if name != "mlp":  # the warm-up scales with the run
        assert abs(warmup - BUILTIN_WARMUP[name] / load_config(name).steps * steps) <= 0.5


def test_steps_20_on_lm_and_finetune_through_the_command_line(capsys):
    for name in ("lm", "finetune"):
        assert main(["config", "show", "--config", name, "steps=20"]) == 0
        shown = yaml.safe_load(capsys.readouterr().out)
        assert shown["steps"] == 20 and "warmup_steps" not in shown["optimizer"]["schedule"]
        assert 0 < shown["optimizer"]["schedule"]["warmup"] < 1


def test_a_fraction_under_half_a_step_is_one_notice_and_no_warmup():
    config = load_config("lm", ["steps=5"])
    assert warmup_steps(config.optimizer.schedule, 5) == 0
    notices = schedule_notices(config)
    assert len(notices) == 1 and "optimizer.schedule.warmup=0.0833 of 5 steps" in notices[0]
    assert "no warm-up" in notices[0]
    assert schedule_notices(load_config("lm", ["steps=20"])) == []


def test_a_warmup_the_length_of_the_run_is_one_notice():
    config = load_config("mlp", ["optimizer.schedule.kind=warmup", "steps=50"])  # 100 steps
    (notice,) = schedule_notices(config)
    assert "lasts the whole run of 50 steps" in notice


def test_an_absolute_warmup_longer_than_the_run_is_one_line_error():
    with pytest.raises(ConfigError, match=r"warmup=50 leaves no steps to decay in 20 total"):
        load_config("lm", ["steps=20", "optimizer.schedule.warmup=50"])


def test_old_names_in_overrides_load_as_the_new_and_warn_once(capsys):
    argv = ["config", "show", "--config", "lm", "log_every=3",
            "optimizer.schedule.warmup_steps=7"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    shown = yaml.safe_load(out)
    assert shown["metrics"]["every"] == 3 and "log_every" not in shown
    assert shown["optimizer"]["schedule"]["warmup"] == 7
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("warning: config key log_every is now metrics.every")
    assert lines[1].startswith("warning: config key optimizer.schedule.warmup_steps is now "
                               "optimizer.schedule.warmup")
    assert main(argv) == 0  # the same process: said once
    assert capsys.readouterr().err == ""


def test_old_names_in_a_file_load_and_name_the_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("base: lm\nlog_every: 7\noptimizer: {schedule: {warmup_steps: 3}}\n")
    with pytest.warns(renamed.RenamedKeyWarning) as said:
        config = load_config(str(path))
    assert [str(w.message).split(";")[0] for w in said] == [
        "config key log_every is now metrics.every",
        "config key optimizer.schedule.warmup_steps is now optimizer.schedule.warmup"]
    assert all(f"rename it in {path}" in str(w.message) for w in said)
    assert config.metrics.every == 7
    assert warmup_steps(config.optimizer.schedule, config.steps) == 3


def test_an_old_name_overrides_the_new_name_of_a_base():
    # lm.yaml gives warmup: 0.0833; an override by the old name replaces it
    with pytest.warns(renamed.RenamedKeyWarning):
        config = load_config("lm", ["optimizer.schedule.warmup_steps=1"])
    assert config.optimizer.schedule.warmup == 1  # type: ignore[union-attr]


def test_both_names_in_one_source_is_one_line_error():
    with pytest.raises(ConfigError, match=r"log_every and metrics\.every are both given in the "
                       r"overrides; keep metrics\.every alone"):
        load_config("mlp", ["log_every=3", "metrics.every=4"])


def test_old_names_through_the_python_api():
    with pytest.warns(renamed.RenamedKeyWarning, match="metrics.every"):
        assert RunConfig.model_validate({"log_every": 5}).metrics.every == 5
    with pytest.warns(renamed.RenamedKeyWarning, match="optimizer.schedule.warmup"):
        schedule = OptimizerConfig(schedule={"kind": "warmup", "warmup_steps": 10}).schedule
    assert warmup_steps(schedule, None) == 10


def test_a_saved_run_config_with_old_names_loads_silently_and_resumes(tmp_path, recwarn):
    config = load_config("lm")
    old = config.to_dict()
    old["log_every"] = old["metrics"].pop("every")
    old["optimizer"]["schedule"]["warmup_steps"] = old["optimizer"]["schedule"].pop("warmup")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    assert config_from_layers(saved_layers(path)) == config
    # a checkpoint's metadata with the old names is the same trajectory
    assert check_config(old, config, allow=False, where=tmp_path) == []
    assert not [w for w in recwarn if issubclass(w.category, renamed.RenamedKeyWarning)]


def test_a_run_warmed_up_in_steps_resumes_under_the_fraction_that_gives_them(tmp_path):
    """A run the built-in lm config started when its warm-up was 50 steps resumes under
    `--config lm`, whose 0.0833 of 600 steps is the same 50; another count is a change."""
    config = load_config("lm")
    old = config.to_dict()
    old["log_every"] = old["metrics"].pop("every")
    old["optimizer"]["schedule"].pop("warmup")
    for steps, same in ((50, True), (49, False)):
        old["optimizer"]["schedule"]["warmup_steps"] = steps
        changes = check_config(old, config, allow=True, where=tmp_path)
        fraction = config.optimizer.schedule.warmup
        assert changes == ([] if same else [f"optimizer.schedule.warmup: {steps} -> {fraction}"])
    with pytest.raises(ConfigChangedError, match="different config"):
        check_config(old, config, allow=False, where=tmp_path)


def test_a_run_says_its_fraction_rounds_to_no_warmup_and_starts_at_the_peak(tmp_path):
    config = load_config("mlp", ["steps=2", "optimizer.schedule.kind=cosine",
                                 "optimizer.schedule.warmup=0.1", "metrics.tensorboard=false"])
    out = io.StringIO()
    trainrun.run(config, tmp_path / "run", out=out)
    said = [line for line in out.getvalue().splitlines() if "optimizer.schedule.warmup" in line]
    assert said == ["warning: optimizer.schedule.warmup=0.1 of 2 steps is less than half a "
                    "step: this run has no warm-up"]
    first = read_metrics(tmp_path / "run" / rundir.METRICS)[0]
    assert first["lr"] == pytest.approx(config.optimizer.lr)  # no step of warm-up
