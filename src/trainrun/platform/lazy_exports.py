"""A package's public names imported from their home modules at first use (a module
``__getattr__``, PEP 562): a command that needs few of them does not wait for the others'
imports (Grain's, for one).

PEP 562's ``__getattr__`` answers reads of the package's attributes (``trainrun.data.X``,
``from trainrun.data import X``), not a global read inside the package's own functions, which
looks in the module's namespace and raises NameError. ``serve_own_reads`` closes that gap: each
function the package defines that reads a lazy name as a global has it imported before it runs.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from types import CodeType
from typing import Any

GLOBAL_READS = ("LOAD_GLOBAL", "LOAD_NAME")


def lazy_exports(package: str, homes: Mapping[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``homes`` (name -> the module
    defining it) imported at its first read and kept in the package, so later reads are
    plain attribute reads."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(sys.modules[package], name, value)  # found once
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *homes])

    return __getattr__, __dir__


def serve_own_reads(package: str, homes: Mapping[str, str]) -> None:
    """Each function defined in ``package`` (called at the end of its module) that reads a
    name of ``homes`` as a global, replaced by one that first imports those names into the
    package (as an outside read would), then calls it."""
    module = sys.modules[package]
    for name, value in list(vars(module).items()):
        if not inspect.isfunction(value) or value.__module__ != package:
            continue
        needed = sorted(_global_reads(value.__code__) & homes.keys())
        if needed:
            setattr(module, name, _serving(module, value, tuple(needed)))


def _serving(module: Any, function: Callable[..., Any], names: tuple[str, ...]
             ) -> Callable[..., Any]:
    @functools.wraps(function)
    def served(*args: Any, **kwargs: Any) -> Any:
        for name in names:
            if name not in vars(module):
                getattr(module, name)  # the module's __getattr__ imports it and keeps it
        return function(*args, **kwargs)

    return served


def _global_reads(code: CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it (lambdas, inner functions,
    comprehensions) read."""
    return {str(ins.argval) for each in _nested(code) for ins in dis.get_instructions(each)
            if ins.opname in GLOBAL_READS}


def _nested(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _nested(const)
