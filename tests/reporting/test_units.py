"""Times print in the unit that reads best: a 415 ms step printed as "415,453.9 µs", a 52 ms
compile as "0.052 s"."""

from __future__ import annotations

import pytest

from trainrun.reporting.report import _split_rows
from trainrun.reporting.units import duration, time_unit
from trainrun.training.summary import RunSummary


@pytest.mark.parametrize(("seconds", "shown"), [
    (0.415453876, "415.5 ms"), (3.16245e-5, "31.62 µs"), (4.2e-9, "4.2 ns"), (12.5, "12.5 s"),
    (0.00099999999, "1 ms"), (0.9999999, "1 s"), (86_400.4, "86,400 s"), (0.0, "0 ns"),
])
def test_a_time_reads_in_its_best_unit(seconds, shown):
    assert duration(seconds) == shown


@pytest.mark.parametrize(("seconds", "unit"), [
    (0.415, (1e-3, "ms")), (3e-5, (1e-6, "µs")), (5e-9, (1e-9, "ns")), (42.0, (1.0, "s")),
    (5000.0, (1.0, "s")),
])
def test_time_unit_is_the_unit_duration_shows(seconds, unit):
    assert time_unit(seconds) == unit
    assert duration(seconds).endswith(f" {unit[1]}")


def test_the_run_summary_prints_every_time_in_its_best_unit():
    provenance = dict.fromkeys(("trainrun", "jax", "jaxlib", "backend", "device_kind",
                                "device_count", "process_count", "python", "xla_flags",
                                "config_digest"), "x")
    summary = RunSummary(final_loss=0.5, steps_done=3, compile_s=0.0523,
                         step_time_median_s=0.415453876, wall_s=2.61,
                         wall_time_split_s={"compile": 0.0523, "step_compute": 1.2463,
                                            "other": 1.3114},
                         provenance=provenance)
    lines = {line.split()[0]: line for line in summary.text().splitlines()[1:]}
    assert lines["compile"].split(None, 1)[1].startswith("52.3 ms (separate")
    assert lines["step"].split(None, 2)[2].startswith("415.5 ms median")
    assert lines["wall"].split(None, 2)[2].startswith(
        "2.61 s: compile 52.3 ms  step_compute 1.246 s  other 1.311 s (goodput")


def test_the_report_splits_the_wall_time_in_best_units():
    assert _split_rows({"compile": 0.0523, "other": 2.5}, 2.5523) == [
        ("compile", "52.3 ms (2.0%)"), ("other", "2.5 s (98.0%)")]
