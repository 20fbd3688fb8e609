"""Measured figures as a reader takes them in: a time in the unit that reads best."""

from __future__ import annotations

# (the largest value, in seconds, a unit is used for; the unit's size in seconds; its name)
_UNITS = ((1e-6, 1e-9, "ns"), (1e-3, 1e-6, "µs"), (1.0, 1e-3, "ms"), (1000.0, 1.0, "s"))
ROUNDS_UP = 0.99995  # a time this close to a unit's bound shows as 1 of the next unit


def time_unit(seconds: float) -> tuple[float, str]:
    """The unit ``duration`` shows ``seconds`` in: (its size in seconds, its name)."""
    for bound, size, name in _UNITS:
        if seconds < bound * ROUNDS_UP:
            return size, name
    return 1.0, "s"


def duration(seconds: float) -> str:
    """A time in seconds as text: four significant digits at most, in the largest unit (ns,
    µs, ms, s) that keeps the number at 1 or more; a thousand seconds and more are whole seconds
    with separators. tests/reporting/test_units.py shows examples."""
    if seconds != seconds or seconds < 0:  # NaN or negative: no unit reads better
        return f"{seconds} s"
    if seconds >= _UNITS[-1][0] * ROUNDS_UP:  # past four digits: whole seconds, separated
        return f"{seconds:,.0f} s"
    size, name = time_unit(seconds)
    return f"{seconds / size:.4g} {name}"
