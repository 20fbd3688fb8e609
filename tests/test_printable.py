"""Names cannot drive the terminal: a config name with control characters, or longer than a
file name may be, is refused before anything is created; run names and paths the commands
print (errors, `runs`, the report) show their control characters as escapes."""

from __future__ import annotations

import io

import pytest
import yaml

from trainrun.cli import main
from trainrun.config import load_config
from trainrun.errors import printable
from trainrun.training.loop import run

EVIL = "evil\x1b]0;TITLE\x07\x1b[31mRED\rX"


def test_printable_escapes_control_characters_and_keeps_the_rest():
    assert printable(EVIL) == "evil\\x1b]0;TITLE\\x07\\x1b[31mRED\\x0dX"
    assert printable("plain name, é ü 名前") == "plain name, é ü 名前"
    assert printable("a\nb\x7f\x9b") == "a\\x0ab\\x7f\\x9b"


@pytest.mark.parametrize("name", [EVIL, "tab\there", "x" * 256, "é" * 128])
def test_a_config_name_that_cannot_be_a_printable_file_name_is_refused(tmp_path, monkeypatch,
                                                                     capsys, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil.yaml").write_text(yaml.safe_dump({**load_config("mlp").to_dict(),
                                                        "name": name}))
    assert main(["train", "--config", "./evil.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a run name" in err, err
    assert not any(c in err for c in "\x1b\x07\r\t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.yaml"]  # no runs/


@pytest.mark.slow
def test_runs_and_the_report_show_a_path_with_control_characters_escaped(tmp_path, capsys):
    config = load_config("mlp", ["steps=4", "checkpoint.every=0", "metrics.tensorboard=false"])
    run(config, tmp_path / "runs" / EVIL, out=io.StringIO())  # --run-dir is the user's path
    assert main(["runs", "--root", str(tmp_path / "runs")]) == 0
    listing = capsys.readouterr().out
    assert "evil\\x1b]0;TITLE\\x07" in listing and "\x1b" not in listing and "\r" not in listing
    assert main(["report", str(tmp_path / "runs" / EVIL)]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\x07" not in printed
    html = (tmp_path / "runs" / EVIL / "report.html").read_text()
    assert "\x1b" not in html and "evil\\x1b" in html
