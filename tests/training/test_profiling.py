"""profile.steps: [a, b] writes a jax.profiler trace holding exactly those steps' calls."""

from __future__ import annotations

import gzip
import io
import json

import pytest

from trainrun.config import ConfigError, load_config
from trainrun.training.loop import run


def _step_calls(trace_file) -> int:
    """How many dispatches of the jitted step program the trace recorded."""
    with gzip.open(trace_file) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("name") == "PjitFunction(train_steps)")
    calls, end = 0, float("-inf")
    for start, stop in spans:  # a dispatch shows as nested events: count the outermost
        if start >= end:
            calls, end = calls + 1, stop
    return calls


def test_profile_window_traces_the_steps_it_names(tmp_path):
    out = io.StringIO()
    run(load_config("mlp", ["steps=12", "metrics.every=4", "checkpoint.every=0",
                            "profile.steps=[5,7]"]), tmp_path / "run", out=out)
    [trace] = (tmp_path / "run" / "profile").glob("plugins/profile/*/perfetto_trace.json.gz")
    assert _step_calls(trace) == 3  # steps 5, 6 and 7: one call each
    assert list(trace.parent.glob("*.xplane.pb"))  # what TensorBoard's profile plugin reads
    text = out.getvalue()
    assert "profile of steps 5-7 written to" in text and "ui.perfetto.dev" in text


def test_profile_window_must_be_two_ordered_steps():
    with pytest.raises(ConfigError, match=r"profile\.steps"):
        load_config("mlp", ["profile.steps=[7,5]"])
