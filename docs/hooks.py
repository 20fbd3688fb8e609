"""Pages made while the site builds: the command-line reference from trainrun's own argparse
parser and the Python API reference from ``trainrun.__all__``, so that neither can fall behind
the code. MkDocs calls ``on_files``; the two page makers are plain functions the tests call."""

from __future__ import annotations

import argparse
import functools
import html
from typing import Any

CLI_PAGE = "reference/cli.md"
API_PAGE = "reference/api.md"


Command = tuple[str, argparse.ArgumentParser]


def _commands(parser: argparse.ArgumentParser, prog: str) -> list[Command]:
    """Every command under ``parser``, depth first: ``[("trainrun train", parser), ...]``."""
    found = [(prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                sub.description = sub.description or helps.get(name)  # a group has only help
                found += _commands(sub, f"{prog} {name}")
    return found


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional
        name = action.metavar or action.dest
        return f"{name} ..." if action.nargs in ("*", "+") else str(name)
    value = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
    return ", ".join(f"{opt}{value}" for opt in action.option_strings)


def _text(text: str) -> str:
    """Help text as Markdown: one line, ``<...>`` shown rather than read as HTML."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _default(value: Any) -> str:
    if value in (None, False, [], argparse.SUPPRESS):
        return ""
    shown = repr(value) if isinstance(value, str) and not value.isprintable() else str(value)
    return f"`{shown}`"


def cli_reference() -> str:
    """The CLI reference page: each command's usage, description and arguments."""
    from trainrun.cli import build_parser

    lines = ["# Command line", "",
             "Generated from `trainrun`'s argparse parser when the site is built; "
             "`trainrun COMMAND --help` prints the same.", ""]
    for prog, parser in _commands(build_parser(), "trainrun"):
        # A fixed width: the page must not depend on the terminal the site was built in.
        parser.formatter_class = functools.partial(argparse.HelpFormatter, width=96)
        parser.prog = prog
        lines += [f"## `{prog}`", "", _text(parser.description or ""), "",
                  "```text", parser.format_usage().strip(), "```", ""]
        rows = []
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                rows += [(f"`{choice.dest}`", "", _text(choice.help or ""))
                         for choice in action._choices_actions]
                continue
            rows.append((f"`{_argument(action)}`", _default(action.default),
                         _text(action.help or "")))
        if rows:
            lines += ["| argument | default | |", "|---|---|---|"]
            lines += [f"| {a} | {d} | {h} |" for a, d, h in rows]
            lines.append("")
    return "\n".join(lines)


def api_reference() -> str:
    """The Python API page: one mkdocstrings entry per name in ``trainrun.__all__``."""
    import trainrun

    lines = ["# Python API", "",
             "Everything `import trainrun` exports (`trainrun.__all__`); anything else is "
             "internal and may move. Generated from the docstrings when the site is built.", ""]
    for name in trainrun.__all__:
        lines += [f"::: trainrun.{name}", ""]
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for uri, content in ((CLI_PAGE, cli_reference()), (API_PAGE, api_reference())):
        files.append(File.generated(config, uri, content=content))
    return files
