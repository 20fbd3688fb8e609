"""The context of a model started from a Hugging Face directory is the source's: the rows a run
reads (``data.seq_len``) may be as long as its ``max_position_embeddings`` (or GPT-2's
``n_positions``), and a longer one is refused in one line that names that key, its file and
the fix, before anything is written."""

from __future__ import annotations

import pytest
from conftest import save_tiny_causal_lm, save_tiny_gpt2

from trainrun.checkpointing.init_from import resolved
from trainrun.cli import main
from trainrun.config import load_config

pytestmark = pytest.mark.slow  # transformers makes the sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    return {"llama": save_tiny_causal_lm(folder / "llama", "llama", vocab_size=256,
                                         max_position_embeddings=512),
            "llama-short": save_tiny_causal_lm(folder / "llama-short", "llama", vocab_size=256,
                                               max_position_embeddings=64),
            "gpt2": save_tiny_gpt2(folder / "gpt2", 256, n_positions=64)}


def test_rows_up_to_the_sources_context_are_read_whatever_the_default(sources):
    """Before, any data.seq_len past 128 (the default of a model section that sets none) was
    refused before the source was read: "drop model.seq_len"."""
    config = resolved(load_config("finetune", [f"init.from={sources['llama']}",
                                               "data.seq_len=256"]))
    assert config.model.seq_len == 256


@pytest.mark.parametrize(("source", "key"), [("llama-short", "max_position_embeddings"),
                                             ("gpt2", "n_positions")])
def test_rows_past_the_sources_context_are_refused_naming_it(sources, tmp_path, capsys,
                                                             source, key):
    path = sources[source]
    code = main(["train", "--config", "finetune", "--run-dir", str(tmp_path / "run"),
                 f"init.from={path}", "data.seq_len=100"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: data.seq_len=100 is longer than the model's context: {key} 64 "
                      f"in {path}/config.json; give data.seq_len=64 or less")
    assert not (tmp_path / "run").exists()
