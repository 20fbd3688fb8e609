"""The single-file examples a user copies: each trains through the same loop."""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest

from trainrun import rundir
from trainrun.reporting.sinks.jsonl import read_metrics

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain_functions", "nnx_module"])
def test_example_trains_and_its_loss_falls(tmp_path, monkeypatch, name):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    summary = load_example(name).main(str(tmp_path / name))
    losses = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first / 5, (first, last)
    assert np.float32(summary.final_loss) == np.float32(losses[-1])  # the same float32


@pytest.mark.slow
def test_callbacks_example_logs_every_row_and_keeps_the_best_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    run_dir = tmp_path / "callbacks"
    summary = load_example("callbacks").main(str(run_dir))
    train = read_metrics(run_dir / "metrics.jsonl")
    evals = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl", "eval")}
    with open(run_dir / "metrics.csv") as f:
        logged = [(int(r["step"]), r["split"], float(r["loss"])) for r in csv.DictReader(f)]
    assert [s for s, split, _ in logged if split == "train"] == [r["step"] for r in train]
    assert {s: v for s, split, v in logged if split == "eval"} == evals
    best = min(evals, key=evals.get)
    assert summary.best_checkpoint == {"step": best, "eval/loss": evals[best]}
    assert best in rundir.committed_steps(run_dir / "checkpoints")


def test_nnx_params_are_a_plain_dict_of_arrays():
    import jax

    example = load_example("nnx_module")
    model = example.trainrun.from_nnx(
        lambda rngs: example.Classifier(16, 8, 4, rngs), example.loss)
    params = model.init(jax.random.key(0))
    assert isinstance(params, dict)
    shapes = {k: {n: v.shape for n, v in layer.items()} for k, layer in params.items()}
    assert shapes == {"hidden": {"kernel": (16, 8), "bias": (8,)},
                      "out": {"kernel": (8, 4), "bias": (4,)}}
