"""A transformer's context and vocabulary come from its data unless the config sets them: one
key to change, not two to keep equal."""

from __future__ import annotations

import pytest
import yaml

from trainrun.cli import main
from trainrun.config import ConfigError, load_config


def test_builtin_models_are_the_sizes_they_were():
    sizes = {name: (load_config(name).model.seq_len, load_config(name).model.vocab)
             for name in ("lm", "lm_bpe", "chat")}
    assert sizes == {"lm": (128, 256), "lm_bpe": (128, 4096), "chat": (64, 264)}


def test_the_context_follows_data_seq_len():
    assert load_config("lm", ["data.seq_len=64"]).model.seq_len == 64
    assert load_config("lm", ["data.seq_len=512"]).model.seq_len == 512  # no "set them equal"
    assert load_config("chat", ["data.seq_len=32"]).model.seq_len == 32


def test_the_vocabulary_follows_the_text_tokenizer():
    assert load_config("lm_bpe", ["data.vocab_size=300"]).model.vocab == 300
    assert load_config("lm_bpe", ["data.tokenizer=null"]).model.vocab == 256  # bytes


def test_a_key_the_config_sets_is_its_own():
    config = load_config("lm", ["data.seq_len=64", "model.seq_len=256"])
    assert (config.model.seq_len, config.data.seq_len) == (256, 64)
    assert load_config("lm_bpe", ["model.vocab=4160"]).model.vocab == 4160
    assert load_config("chat").model.vocab == 264  # records: the config's own


def test_a_shorter_context_set_by_hand_is_one_line_error():
    with pytest.raises(ConfigError, match=r"data\.seq_len=256 is longer than the model's context "
                       r"model\.seq_len=128; drop model\.seq_len"):
        load_config("lm", ["data.seq_len=256", "model.seq_len=128"])
    with pytest.raises(ConfigError, match=r"drop model\.vocab \(it follows data\.vocab_size\)"):
        load_config("lm_bpe", ["model.vocab=1000"])


def test_a_bad_data_value_is_named_as_the_datas():
    with pytest.raises(ConfigError, match=r"'data\.seq_len'"):
        load_config("lm", ["data.seq_len=0"])


def test_init_from_gives_the_model_instead():
    # the source's architecture (checkpointing/init_from.py) decides; the data does not
    config = load_config("finetune", ["init.from=somewhere", "data.seq_len=64"])
    assert "seq_len" not in config.model.model_fields_set


def test_config_show_names_the_data_as_the_origin(capsys):
    assert main(["config", "show", "--config", "lm_bpe", "data.seq_len=96"]) == 0
    out = capsys.readouterr().out
    model = out[out.index("\nmodel:"):out.index("\ndata:")]
    assert "seq_len: 96" in model and "# data.seq_len" in model
    assert "# data.vocab_size" in model
    assert yaml.safe_load(out)["model"]["seq_len"] == 96
