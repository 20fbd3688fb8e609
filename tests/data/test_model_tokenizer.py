"""A model directory's tokenizer files are read from inside it: a symbolic link out of it (to a
secret) is refused on one line naming the link and its target, and a Hugging Face hub
snapshot's links into its repository's blobs/ read as the files themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainrun.data import DataError
from trainrun.data.chat import CHATML
from trainrun.data.model_tokenizer import byte_tokenizer, load

SECRET = "root:x:0:0:root:/root:/bin/bash\n"


def model_dir(folder: Path) -> dict[str, str]:
    """The files of a small model directory's tokenizer (bytes as tokens, a chatml template),
    by name, written into ``folder``."""
    files = {"tokenizer.json": byte_tokenizer().tokenizer.to_str(),
             "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"}),
             "generation_config.json": json.dumps({"eos_token_id": 258}),
             "chat_template.jinja": CHATML}
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json",
                                  "tokenizer.json", "generation_config.json"])
def test_a_file_linking_out_of_the_model_directory_is_refused(tmp_path, name):
    """Before, a chat_template.jinja linking to /etc/passwd became the chat template."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    folder = tmp_path / "model"
    model_dir(folder)
    (folder / name).unlink()
    (folder / name).symlink_to(secret)
    with pytest.raises(DataError) as refused:
        load(str(folder))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"{folder}/{name} is a symbolic link to {secret}, outside {folder}")


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json"])
def test_training_on_a_file_linking_out_is_one_line_and_exit_2(tmp_path, capsys, name):
    from trainrun.cli import main

    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    folder = tmp_path / "model"
    model_dir(folder)
    (folder / name).unlink()
    (folder / name).symlink_to(secret)
    records = tmp_path / "chat.jsonl"
    records.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "ok"}]}) + "\n")
    run_dir = tmp_path / "runs" / "linked"
    code = main(["train", "--config", "chat", "--run-dir", str(run_dir), "data.synthetic=null",
                 f"data.paths={records}", f"data.tokenizer={folder}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{folder}/{name} is a symbolic link to {secret}, outside {folder}: " in err[0]
    assert "root:" not in err[0] and not run_dir.exists()


def test_a_hub_snapshots_links_into_its_repository_are_read(tmp_path):
    """snapshots/<revision>/<file> -> ../../blobs/<hash>, as the hub cache lays a model out;
    a link to another snapshot of the same repository is inside it too."""
    repo = tmp_path / "hub" / "models--me--tiny"
    files = model_dir(repo / "blobs")
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    older = repo / "snapshots" / "fedcba9"
    older.mkdir()
    for name in files:
        (repo / "blobs" / name).rename(repo / "blobs" / f"blob-{name}")
        (older / name).symlink_to(Path("..", "..", "blobs", f"blob-{name}"))
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"blob-{name}"))
    (snapshot / "chat_template.jinja").unlink()
    (snapshot / "chat_template.jinja").symlink_to(Path("..", "fedcba9", "chat_template.jinja"))
    found = load(str(snapshot))
    assert found.template is not None and found.template.source == CHATML
    assert found.stop_ids == (256, 258) and found.special == {"eos_token": "<|endoftext|>"}
    assert found.tokenizer.to_str() == files["tokenizer.json"]
