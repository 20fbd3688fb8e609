"""A package's public names imported from their home modules at first use (a module
``__getattr__``, PEP 562): a command that needs few of them does not wait for the others'
imports (Grain's, for one)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


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
