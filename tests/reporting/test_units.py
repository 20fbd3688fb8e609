"""Times print in the unit that reads best: a 415 ms step printed as "415,453.9 µs"."""

from __future__ import annotations

import pytest

from trainrun.reporting.units import duration


@pytest.mark.parametrize(("seconds", "shown"), [
    (0.415453876, "415.5 ms"), (3.16245e-5, "31.62 µs"), (4.2e-9, "4.2 ns"), (12.5, "12.5 s"),
    (0.00099999999, "1 ms"), (0.9999999, "1 s"), (86_400.4, "86,400 s"), (0.0, "0 ns"),
])
def test_a_time_reads_in_its_best_unit(seconds, shown):
    assert duration(seconds) == shown
