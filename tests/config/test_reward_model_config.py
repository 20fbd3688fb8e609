"""The ``reward_model`` section: TRL's defaults, no ``preference`` section added beside it, kept
out of other runs' configs, refused beside another kind's section or on data it cannot train
on, its score head trained beside LoRA adapters, and the pad token TRL pads with."""

from __future__ import annotations

import pytest

from trainrun.config import ConfigError, load_config
from trainrun.training.reward_run import with_pad_id


def test_the_section_holds_trls_defaults_and_takes_the_place_of_preference():
    config = load_config("reward")
    assert config.reward_model is not None and config.preference is None
    assert config.reward_model.model_dump() == {
        "center_rewards_coefficient": None, "margin": False, "max_prompt": 512,
        "max_completion": 0}
    saved = config.to_dict()
    assert "reward_model" in saved and "preference" not in saved
    assert "reward_model" not in load_config("dpo").to_dict()


@pytest.mark.parametrize(("base", "overrides", "words"), [
    ("chat", ["reward_model={}"], "the reward_model section trains on preference records, not "
     "data.format=chat"),
    ("reward", ["preference={}"], "a run trains a reward model or tunes by preference, not "
     "both"),
    ("reward", ["eval.generate=4"], "a reward model generates none; set eval.generate=0"),
    ("reward", ["reward_model.center_rewards_coefficient=-1"],
     "reward_model.center_rewards_coefficient"),
])
def test_settings_that_do_not_fit_a_reward_model_are_one_line(base, overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(base, overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_with_lora_the_score_head_trains_beside_the_adapters():
    config = load_config("reward", ["model.lora={rank: 4}"])
    assert config.optimizer.trainable == [r"_lora\.(a|b)$", "^score$"]
    dpo = load_config("dpo", ["model.lora={rank: 4}"])
    assert dpo.optimizer.trainable == [r"_lora\.(a|b)$"]


def test_the_pad_token_is_the_configs_or_else_the_tokenizers_as_trl_pads():
    assert with_pad_id(load_config("reward")).model.pad_id == 256  # bytes: its end of text
    assert with_pad_id(load_config("reward", ["model.pad_id=7"])).model.pad_id == 7
    assert with_pad_id(load_config("dpo")).model.pad_id is None  # not a reward run
