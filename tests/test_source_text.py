"""Comments and docstrings hold no measured figures and no CPU model names: figures live in
BENCHMARKS.md (with command, date and CPU), and a comment points to its section."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "trainrun"

# A number followed by a unit of time or size ("3.4 µs", "22us", "47 ms", "6.6 GB", "64 KiB").
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:µs|us|ms|[kKMGT]i?B)(?!\w)"
                    r"|\d(?:\.\d+)?x (?:faster|slower|cheaper|dearer)\b"
                    r"|\d[\d,]* page faults")
CPU_NAME = re.compile(r"(?i:\b(?:EPYC|Xeon|Ryzen)\b)|\bAVX|\bAMX\b")
# Tokens after which a string starts a statement of its own (an expression statement).
STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
SKIPPED = {tokenize.NL, tokenize.COMMENT}


def flagged(text: str) -> bool:
    return bool(FIGURE.search(text) or CPU_NAME.search(text))


def python_text(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring line in ``source``: a docstring is a string
    that is an expression statement of its own (code's strings, e.g. "ms" in a format, are not
    read)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines: list[tuple[int, str]] = []
    previous = None  # the last token that is not a comment or a blank line
    for index, token in enumerate(tokens):
        if token.type == tokenize.COMMENT:
            lines.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and (previous is None
                                                or previous.type in STATEMENT_START):
            following = next((t for t in tokens[index + 1:] if t.type not in SKIPPED), None)
            if following is None or following.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                lines += [(token.start[0] + offset, line)
                          for offset, line in enumerate(token.string.splitlines())]
        if token.type not in SKIPPED:
            previous = token
    return lines


def yaml_text(text: str) -> list[tuple[int, str]]:
    """(line, text) of every comment in a YAML file: from a ``#`` that starts the line or
    follows a space."""
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        match = re.search(r"(?:^|\s)(#.*)", line)
        if match:
            lines.append((number, match.group(1)))
    return lines


def figures(path: Path, text: str) -> list[str]:
    """``path:line: text`` for every comment or docstring line of ``text`` holding a measured
    figure or a CPU model name."""
    lines = python_text(text) if path.suffix == ".py" else yaml_text(text)
    return [f"{path}:{number}: {line.strip()}" for number, line in lines if flagged(line)]


def test_no_measured_figures_in_source_text():
    found = []
    for path in sorted([*SRC.rglob("*.py"), *SRC.rglob("*.yaml")]):
        found += figures(path.relative_to(SRC.parents[1]), path.read_text(encoding="utf-8"))
    assert not found, ("measured figures or CPU names in comments or docstrings (move them to "
                       "BENCHMARKS.md and point to its section):\n" + "\n".join(found))


PLANTED = '''"""A module. Its step took 3.4 µs on an AMD EPYC."""

BUFFER = 1 << 20  # a configuration constant, not a figure
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def show(seconds):
    """Seconds as text."""
    label = "12 ms"  # a string in code is not a comment
    return f"{seconds * 1e3:.1f} ms"  # writes 47 ms before, 2.6x cheaper now


def other():
    x = 1
    """A string statement in a body counts too: 493 MB a step, AVX-512."""
    return x
'''


def test_scanner_catches_planted_figures():
    found = figures(Path("planted.py"), PLANTED)
    assert [line.split(":")[1] for line in found] == ["1", "10", "15"], found
    yaml = "a: 1  # 32 KB of text\nb: \"x\"  # gathering takes microseconds\n# on a Xeon\n"
    assert [line.split(":")[1] for line in figures(Path("c.yaml"), yaml)] == ["1", "3"]
    for clean in ("1 << 20", "the sha256 of 64 files", "K=100 steps", "float32",
                  "a 2-core machine", "16x wider head", "users", "items/s"):
        assert not flagged(clean), clean
    for dirty in ("22us a step", "1,437 ms", "0.8 GB", "64KiB", "1.8x faster", "AVX512-BF16",
                  "120,000 page faults", "12 MB/s", "43.0 µs/step"):
        assert flagged(dirty), dirty
