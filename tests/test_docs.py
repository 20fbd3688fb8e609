"""The documentation site's promises: every quickstart command runs as written, and the
generated references cover every command of the CLI and every name of ``trainrun.__all__``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO, cli_env

import trainrun
from trainrun.cli import build_parser


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quickstart_commands() -> list[str]:
    """The commands of docs/quickstart.md's ```bash blocks, one per line, as written."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")  # continuation lines
    return [line for line in joined.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.slow
def test_every_quickstart_command_runs_as_written(tmp_path):
    commands = quickstart_commands()
    assert any(c.startswith("trainrun train") for c in commands), commands
    env = cli_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    # What the quickstart says they leave behind.
    assert (tmp_path / "runs" / "mlp" / "report.html").is_file()
    assert (tmp_path / "runs" / "digits" / "summary.json").is_file()


def test_api_page_documents_every_public_name():
    page = hooks().api_reference()
    documented = re.findall(r"^::: trainrun\.(\w+)$", page, flags=re.M)
    assert documented == list(trainrun.__all__)
    for name in trainrun.__all__:  # an entry without a docstring would be an empty heading
        assert (getattr(trainrun, name).__doc__ or "").strip(), name


def test_cli_page_covers_every_command():
    page = hooks().cli_reference()
    titles = re.findall(r"^## `(trainrun[^`]*)`$", page, flags=re.M)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, sub in commands.items():
        assert f"trainrun {name}" in titles
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in page or f", {option}" in page, (name, option)
    assert "trainrun config show" in titles and "trainrun bench ceiling" in titles
    assert "runs/&lt;config name&gt;" in page  # help text kept whole, not read as HTML
