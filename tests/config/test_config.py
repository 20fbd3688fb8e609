"""Config loading, overrides and the one-line errors for bad keys and types."""

from __future__ import annotations

import pytest

from trainrun.config import ConfigError, builtin_config_names, load_config


@pytest.mark.slow
def test_builtin_config_resolves_by_name_from_any_directory(tmp_path, cli):
    result = cli("train", "--config", "mlp", "--run-dir", str(tmp_path / "r"), "steps=3",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mlp" in builtin_config_names()


def test_overrides_are_typed_and_nested():
    config = load_config("mlp", ["optimizer.lr=0.003", "steps=7", "model.hidden=[16, 16]"])
    assert config.optimizer.lr == 0.003
    assert config.steps == 7
    assert config.model.hidden == [16, 16]


def test_unknown_key_names_the_key_and_closest_valid_names():
    with pytest.raises(ConfigError) as err:
        load_config("mlp", ["optimizer.lrr=0.1"])
    message = str(err.value)
    assert "'optimizer.lrr'" in message
    assert "did you mean 'lr'" in message


def test_unknown_top_level_key_lists_close_matches():
    with pytest.raises(ConfigError, match=r"did you mean 'steps'"):
        load_config("mlp", ["stepz=5"])


def test_wrong_type_names_field_expected_type_and_value():
    with pytest.raises(ConfigError) as err:
        load_config("mlp", ["steps=many"])
    message = str(err.value)
    assert "'steps'" in message and "int" in message and "'many'" in message


@pytest.mark.parametrize(("override", "says"), [
    ("preference=abc", "config key 'preference' expects a mapping of keys or null, got 'abc' "
                       "(str)"),
    ("model=3", "config key 'model' expects a mapping of keys with kind: mlp, nnx_mlp, cnn, "
                "resnet or transformer, got 3 (int)"),
    ("model.lora=3", "config key 'model.lora' expects a mapping of keys or null, got 3 (int)"),
    ("model.kv_heads=abc", "config key 'model.kv_heads' expects int or null, got 'abc' (str): "
                           "Input should be a valid integer"),
    ("data.synthetic=foo", "config key 'data.synthetic' expects one of 'reverse', 'add', "
                           "'last', 'letter' or null, got 'foo' (str)"),
    ("preference.beta=abc", "config key 'preference.beta' expects float, got 'abc' (str)"),
    ("data.mix=3", "config key 'data.mix' expects a list of mappings of keys, got 3 (int)"),
    ("data.paths={a: 1}", "config key 'data.paths' expects list[str], got {'a': 1} (a "
                          "mapping)"),
    ("data.mix=[{weight: 1}]", "config key 'data.mix.0.source' is required"),
    ("model.tie_embeddings=maybe", "expects bool (true or false), got 'maybe' (str)"),
])
def test_type_errors_name_the_type_as_a_config_is_written(override, says):
    """Before: "expects trainrun.config.sections.PreferenceConfig | None", "Union[...]", and
    preference.beta named its section's type."""
    with pytest.raises(ConfigError) as err:
        load_config("dpo", [override])
    assert says in str(err.value)
    assert "trainrun." not in str(err.value) and "Config" not in str(err.value)


def test_unknown_kind_lists_the_known_kinds():
    with pytest.raises(ConfigError, match=r"model\.kind: unknown kind 'mlpp'"):
        load_config("mlp", ["model.kind=mlpp"])


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))


def test_unknown_config_name_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean 'mlp'"):
        load_config("mpl")


@pytest.mark.parametrize(("override", "expected"), [
    ("optimizer.lrr=0.1", "unknown config key 'optimizer.lrr'; did you mean 'lr'?"),
    ("steps=many", "config key 'steps' expects int, got 'many'"),
    ("optimizer.eps=0", "config key 'optimizer.eps' expects float, got 0 (int): Input should "
                        "be greater than 0"),
    ("model.hidden=[0]", "config key 'model.hidden.0' expects list[int], got 0 (int): Input "
                         "should be greater than 0"),
    ("seed=99999999999999999999", "config key 'seed' expects int, got 99999999999999999999 "
                                  "(int): Input should be less than or equal to 4294967295"),
    ("seed=-1", "Input should be greater than or equal to 0"),
    ("optimizer.lr=.inf", "config key 'optimizer.lr' expects float, got inf (float): Input "
                          "should be a finite number"),
    ("optimizer.lr=.nan", "Input should be a finite number"),
    ("model.hidden=[1", "override 'model.hidden=[1': '[1' is not a valid YAML value"),
    ("name=../x", "config key 'name': a run name is a plain file name"),
    ("name=/abs/path", "a run name is a plain file name"),
    ("name=", "a run name is a plain file name"),
    ("name=..", "a run name is a plain file name"),
])
@pytest.mark.slow
def test_cli_config_errors_exit_2_with_one_line_and_no_traceback(tmp_path, cli, override,
                                                                  expected):
    result = cli("train", "--run-dir", str(tmp_path / "r"), override)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()  # nothing written for a config that never ran


@pytest.mark.parametrize(("overrides", "says"), [
    (["model.lora={targets: [router]}"], "names router, which only a mixture of experts"),
    (["model.mlp=swiglu", "model.fused_projections=true", "model.lora={targets: [q, o]}"],
     "names q without k and v; this model fuses q, k and v into one qkv_proj"),
])
def test_lora_targets_the_model_cannot_hold_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config("lm", overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("overrides", "says"), [
    (["model.heads=3"], "d_model=128 is not a multiple of heads=3; change one, or set head_dim"),
    (["model.kv_heads=3"], "heads=4 is not a multiple of kv_heads=3; each key/value head"),
    (["model.head_dim=5"], "rotary positions need an even head dimension, not 5"),
    (["model.sliding_window=4", "model.sliding_layers=[2]"],
     "model.sliding_layers=[2] names a layer outside 0..1"),
    (["model.sliding_layers=[0]"], "model.sliding_layers is set without model.sliding_window"),
    (["model.sliding_window=4", "model.sliding_layers=[0]", "model.scan_layers=true"],
     "model.scan_layers=true needs every layer alike"),
    (["model.mlp=swiglu", "model.experts=2", "model.experts_per_token=3"],
     "model.experts_per_token=3 is more than model.experts=2"),
    (["model.experts=2"], "model.experts needs a gated MLP"),
    (["model.lora={targets: [gate]}"], "names gate, which only model.mlp=swiglu has"),
    # several at once: the heads are checked first, then the layers, experts and adapters
    (["model.heads=3", "model.sliding_layers=[9]", "model.experts=2"], "heads=3"),
    (["model.sliding_layers=[9]", "model.experts=2", "model.lora={targets: [gate]}"],
     "model.sliding_layers=[9]"),
    (["model.experts=2", "model.lora={targets: [gate]}"], "model.experts needs a gated MLP"),
])
def test_model_shapes_that_do_not_fit_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config("lm", overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


# ---- preference tuning -----------------------------------------------------------------------


def test_the_preference_section_holds_trls_defaults_and_leaves_other_digests_alone():
    config = load_config("dpo", ["preference=null"])  # the section follows data.format
    assert config.preference is not None
    defaults = config.preference.model_dump()
    assert defaults == {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0,
                        "simpo_gamma": 0.5, "nll_weight": 0.0, "max_prompt": 512,
                        "max_completion": 0, "reference": "cached",
                        "reference_batch_size": 32}
    assert "preference" in config.to_dict()
    chat = load_config("chat")
    assert chat.preference is None and "preference" not in chat.to_dict()


@pytest.mark.parametrize("overrides,words", [
    (["preference={loss: sigmoid}"], "the preference section trains on preference records, "
     "not data.format=chat"),
    (["preference.loss=hinge", "preference.label_smoothing=0.1"],
     "label_smoothing applies to the sigmoid, robust and simpo losses, not hinge"),
    (["data.synthetic=reverse"], "pair data.synthetic=last with data.format=preference"),
])
def test_preference_settings_that_do_not_fit_are_one_line(overrides, words):
    base = "chat" if overrides[0].startswith("preference={") else "dpo"
    with pytest.raises(ConfigError) as err:
        load_config(base, overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


# ---- reinforcement learning ------------------------------------------------------------------


def test_the_rl_section_holds_trls_defaults_and_leaves_other_digests_alone():
    config = load_config("chat", ["steps_per_call=1", "eval.every=0",
                                  "rl={rewards: [{name: exact_match}]}"])
    assert config.rl is not None
    defaults = config.rl.model_dump()
    assert defaults == {"group": 8, "prompts": 4, "completion_tokens": 64, "temperature": 1.0,
                        "top_p": 1.0, "stop_strings": (),
                        "rewards": ({"name": "exact_match", "weight": 1.0, "args": {}},),
                        "reward_timeout": 3600.0, "beta": 0.0, "clip_low": 0.2, "clip_high": 0.2,
                        "normalisation": "dapo", "updates": 1, "scale_rewards": True,
                        "log_completions": {"every": 0, "count": 4}}
    assert "rl" in config.to_dict()
    chat = load_config("chat")
    assert chat.rl is None and "rl" not in chat.to_dict()


@pytest.mark.parametrize("overrides,words", [
    (["rl.rewards=[]"], "rl.rewards"),
    (["rl.updates=2"], "set steps_per_call=2"),
    (["rl.updates=2", "steps_per_call=2", "steps=101"], "steps=101 is not a multiple of "
     "rl.updates=2"),
    (["rl.updates=2", "steps_per_call=2", "checkpoint.every=5"], "checkpoint.every=5 is not a "
     "multiple"),
    (["data.format=preference", "data.synthetic=last"], "not data.format=preference"),
    (["model={kind: mlp}"], "rl trains a transformer"),
    (["rl.stop_strings=['']"], "a stop string is empty"),
    (["rl.group=1"], "rl.group"),
    (["rl.reward_timeout=0"], "should be greater than 0"),
    (["rl.updates=2", "steps_per_call=2", "metrics.every=2", "eval.every=5"],
     "eval.every=5 is not a multiple"),
])
def test_rl_settings_that_do_not_fit_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config("grpo", overrides)
    assert words in str(err.value) and "\n" not in str(err.value)
