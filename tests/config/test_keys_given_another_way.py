"""A later layer (the command line over a file, a file over its base) that gives something
another way than a lower layer did wins, where the two would otherwise be refused together:
``key=null`` unsets a key, a record source displaces the file's other source, and a model to
start from (``init.from``) displaces the file's toy model and byte tokenizer, which the model
gives. What one layer gives together is kept, and checked against the source."""

from __future__ import annotations

import pytest

from trainrun.cli import main
from trainrun.config import ARCHITECTURE, ConfigError, load_config

GIVEN = set(ARCHITECTURE) - {"seq_len"}  # the context stays the run's choice


@pytest.mark.parametrize("name", ["dpo", "grpo", "chat"])
def test_a_model_to_start_from_displaces_the_files_model_and_tokenizer(name):
    """Before, the built-in configs' d_model, vocab, ... stood beside init.from and were
    refused as contradicting the source's config.json."""
    config = load_config(name, ["init.from=models/any"])
    assert not GIVEN & config.model.model_fields_set, config.model.model_fields_set
    assert config.model.kind == "transformer"
    assert config.data.tokenizer is None and config.data.chat_template is None  # type: ignore
    assert config.data.seq_len == load_config(name).data.seq_len  # the run's own


def test_what_the_same_layer_gives_with_init_from_stays_to_be_checked(tmp_path):
    config = load_config("dpo", ["init.from=models/any", "model.d_model=64",
                                 "data.chat_template=chatml"])
    assert config.model.d_model == 64 and "d_model" in config.model.model_fields_set
    assert config.data.chat_template == "chatml"  # type: ignore[union-attr]
    own = tmp_path / "own.yaml"  # a file that gives both: neither displaces the other
    own.write_text("base: dpo\ninit: {from: models/any}\nmodel: {layers: 3}\n")
    config = load_config(str(own))
    assert config.model.model_fields_set & GIVEN == {"layers"}
    # a bare weights file names no architecture: the file's model stands
    assert load_config("dpo", ["init.from=w.safetensors"]).model.d_model == 64


def test_a_record_source_displaces_the_files_other_source():
    """Before: "give one of data.paths ... got data.paths and data.synthetic"."""
    config = load_config("dpo", ["data.paths=pairs.jsonl"])
    assert config.data.paths == ("pairs.jsonl",) and config.data.synthetic is None  # type: ignore
    with pytest.raises(ConfigError, match=r"got data\.paths and data\.synthetic"):
        load_config("dpo", ["data.paths=pairs.jsonl", "data.synthetic=last"])


def test_null_unsets_a_key_which_then_takes_its_default_or_follows():
    """Before: "config key 'model.vocab' expects int, got None"."""
    config = load_config("dpo", ["model.vocab=null", "model.d_model=null"])
    assert config.model.vocab == 259  # follows data.tokenizer: bytes and three special tokens
    assert config.model.d_model == 128  # the default
    assert load_config("dpo", ["preference=null"]).preference is not None  # follows the data


def test_config_show_names_init_from_and_null_where_they_give_a_value(capsys):
    assert main(["config", "show", "--config", "dpo", "init.from=models/any",
                 "model.vocab=null", "data.paths=pairs.jsonl"]) == 0
    shown = {line.split(":")[0].strip(): line.split("#")[1].strip()
             for line in capsys.readouterr().out.splitlines() if "#" in line}
    assert shown["d_model"] == shown["vocab"] == shown["tokenizer"] == "init.from"
    assert shown["synthetic"] == "default" and shown["paths"] == "override"
