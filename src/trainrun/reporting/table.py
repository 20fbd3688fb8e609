"""The table of training metrics: consecutive steps' scalar metrics as one float32 array, the
form in which the loop reads them and every sink and hook takes them."""

from __future__ import annotations

import dataclasses

import numpy as np

Rows = list[tuple[int, dict[str, float]]]


@dataclasses.dataclass(frozen=True)
class Table:
    """Consecutive steps' metrics: ``values[i]`` (float32, columns ``names``) is step
    ``first + i``."""

    first: int
    names: list[str]
    values: np.ndarray  # [steps, len(names)]

    @property
    def last(self) -> int:
        return self.first + len(self.values) - 1

    def row(self, i: int) -> dict[str, float]:
        return dict(zip(self.names, self.values[i].tolist(), strict=True))

    def rows(self) -> Rows:
        return [(self.first + i, dict(zip(self.names, row, strict=True)))
                for i, row in enumerate(self.values.tolist())]
