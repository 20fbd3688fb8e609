"""A location is made once where a path enters and carries its store and its checks: below
that, nothing parses the path again to learn which store it is on."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

import trainrun
from trainrun.config import config_from_dict
from trainrun.storage import location, remote


def _calls_of(function, during) -> int:
    """How many times ``function`` runs while ``during()`` does (a profile of every call)."""
    code, seen = function.__code__, [0]

    def profile(frame, event, _):
        if event == "call" and frame.f_code is code:
            seen[0] += 1

    sys.setprofile(profile)
    try:
        during()
    finally:
        sys.setprofile(None)
    return seen[0]


@pytest.mark.slow
def test_load_asks_which_store_a_path_is_on_once(tmp_path):
    config = config_from_dict({
        "steps": 2, "model": {"kind": "transformer", "d_model": 32, "layers": 1, "heads": 2},
        "data": {"kind": "records", "synthetic": "reverse", "synthetic_examples": 64,
                 "seq_len": 32, "batch_size": 8}})
    trainrun.run(config, tmp_path / "run", out=io.StringIO())
    trainrun.load(str(tmp_path / "run"))  # imports and compilations first
    assert _calls_of(remote.is_remote, lambda: trainrun.load(str(tmp_path / "run"))) == 1


def test_a_location_is_made_once_and_handed_on_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    here = location.location("~/runs/x")
    assert isinstance(here, location.LocalLocation) and here == tmp_path / "runs" / "x"
    assert location.location(here) is here
    assert _calls_of(remote.is_remote, lambda: (here / "config.yaml").parent) == 0


def test_a_remote_join_is_checked_as_the_location_was():
    there = remote.ObjectLocation("gs://bucket/runs")
    assert str(there / "lm" / "config.yaml") == "gs://bucket/runs/lm/config.yaml"
    assert (there / "lm").parent == there and (there / "lm").name == "lm"
    for bad in ("..", "a//b", "./a"):
        with pytest.raises(remote.BadLocation):
            there / bad


def test_the_store_says_how_it_differs_not_the_path():
    here, there = location.location("runs/x"), remote.ObjectLocation("s3://bucket/runs/x")
    assert here.renames and not there.renames
    assert here.local_path == Path("runs/x") and there.local_path is None
    assert not there.real().is_relative_to(here.real().parent)  # never inside a local folder
    assert there.real().is_relative_to(remote.ObjectLocation("s3://bucket/runs").real())
