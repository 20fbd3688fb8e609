"""The tokenizer a command reads text with, from a model directory: its config.json is read
from inside the directory only."""

from __future__ import annotations

import json

import pytest

from trainrun.data.model_tokenizer import byte_tokenizer
from trainrun.evaluation.text_tokens import TokenizerError, load_tokenizer


def test_a_config_json_linking_out_of_the_model_directory_is_refused(tmp_path):
    """Before, the bos and eos ids of a config.json linking elsewhere were taken as the
    model's."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(byte_tokenizer().tokenizer.to_str())
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"bos_token_id": 5, "eos_token_id": 5}))
    (folder / "config.json").symlink_to(elsewhere)
    with pytest.raises(TokenizerError) as refused:
        load_tokenizer(folder)
    assert str(refused.value).startswith(
        f"{folder}/config.json is a symbolic link to {elsewhere}, outside {folder}: ")
