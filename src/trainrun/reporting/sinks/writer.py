"""What every metrics sink is: one destination behind one small protocol."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from trainrun.reporting.table import Table


class Writer(Protocol):
    """One destination of metrics (a file, a service)."""

    def write(self, step: int, metrics: Mapping[str, float], split: str = "train") -> None:
        """One step's metrics (an eval row, a timing window, a streamed row)."""

    def write_table(self, table: Table, split: str = "train") -> None:
        """Consecutive training steps' metrics at once."""

    def flush(self) -> None:
        """What was written so far reaches the destination."""

    def close(self) -> None: ...
