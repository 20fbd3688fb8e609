"""Non-finite steps: ``skip`` leaves the state as it was and counts the step; ``halt`` stops the
run naming the step, with the last good checkpoint intact."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest

from trainrun.config import MLPModel, OptimizerConfig, RegressionData, load_config
from trainrun.data.synthetic import regression_arrays
from trainrun.fast.guard import keep_if_not_branched
from trainrun.models.mlp import make_mlp
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import keep_if_not, make_train_step
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run
from trainrun.training.nonfinite import NonFiniteError


def same_bits(a, b) -> bool:
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def full_batch() -> dict[str, np.ndarray]:
    return regression_arrays(RegressionData())


def poisoned(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = batch["x"].copy()
    x[3, 2] = np.nan
    return {**batch, "x": x}


@pytest.mark.slow
@pytest.mark.parametrize("branches", [False, True])  # a select of each leaf; branches on CPU
def test_a_nan_batch_is_skipped_leaving_params_and_optimizer_state_bitwise_unchanged(branches):
    model = make_mlp(MLPModel())
    warmup = OptimizerConfig(lr=0.01, schedule={"kind": "warmup", "warmup": 10})
    optimizer = build_optimizer(warmup, total_steps=20)
    keep = keep_if_not_branched if branches else keep_if_not
    step = jax.jit(make_train_step(model, optimizer, keep=keep))
    good, bad = full_batch(), poisoned(full_batch())

    s1, _ = step(init_state(model, optimizer, seed=0), good)
    s2, m2 = step(s1, bad)
    assert np.isnan(m2["loss"])
    assert same_bits(s2.params, s1.params)
    assert same_bits(s2.opt_state, s1.opt_state)
    assert (int(s2.step), int(s2.nonfinite_steps)) == (2, 1)
    assert int(m2["nonfinite_steps"]) == 1

    # The schedule did not move either: the next good step uses the lr the skipped one would
    # have, and makes exactly the update a run that never saw the bad batch makes.
    s3, m3 = step(s2, good)
    reference, m_ref = step(s1, good)
    assert float(m3["lr"]) == float(m_ref["lr"]) == pytest.approx(0.001)  # 1 update done
    assert same_bits(s3.params, reference.params)
    assert same_bits(s3.opt_state, reference.opt_state)
    assert int(s3.nonfinite_steps) == 1  # the count stays in the state (and its checkpoints)


def batches_with_nan_at(step: int, total: int):
    """Full batches; the one of ``step`` (1-based) holds a NaN."""
    for s in range(1, total + 1):
        yield poisoned(full_batch()) if s == step else full_batch()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 5])
def test_skip_counts_the_step_in_the_metrics_and_training_goes_on(tmp_path, k):
    config = load_config("mlp", ["steps=20", "metrics.every=5", f"steps_per_call={k}"])
    out = io.StringIO()
    run(config, tmp_path / "nan", data=batches_with_nan_at(3, 20), out=out)
    records = read_metrics(tmp_path / "nan" / "metrics.jsonl")
    assert [r["nonfinite_steps"] for r in records] == [0, 0] + [1] * 18
    assert records[2]["loss"] is None and "loss" in records[2]["nonfinite"]
    assert "step 3: loss or gradients not finite; update skipped" in out.getvalue()

    # With full batches and a deterministic model, skipping step 3 is exactly a run one step
    # shorter: steps 4..20 reproduce steps 3..19 of a clean run, bit for bit.
    run(load_config("mlp", ["steps=19", f"steps_per_call={k}"]), tmp_path / "clean",
        out=io.StringIO())
    clean = [r["loss"] for r in read_metrics(tmp_path / "clean" / "metrics.jsonl")]
    assert [r["loss"] for r in records[3:]] == clean[2:]


def test_halt_raises_naming_the_step(tmp_path):
    config = load_config("mlp", ["steps=20", "metrics.every=5", "nonfinite=halt"])
    with pytest.raises(NonFiniteError, match=r"^step 3: loss or gradients are not finite"):
        run(config, tmp_path, data=batches_with_nan_at(3, 20), out=io.StringIO())
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records[2]["step"] == 3 and records[2]["loss"] is None  # recorded, then halted
    assert records[-1]["step"] < 20


@pytest.mark.slow
def test_halt_through_the_cli_exits_2_and_keeps_the_last_good_checkpoint(tmp_path, cli):
    # 512 examples in batches of 64; row 300 (batch 5, so step 5) holds a NaN.
    data = full_batch()
    x = np.concatenate([data["x"], data["x"]])
    y = np.concatenate([data["y"], data["y"]])
    x[300, 0] = np.nan
    np.savez(tmp_path / "data.npz", x=x, y=y)
    config = tmp_path / "nan.yaml"
    config.write_text(f"steps: 12\nmetrics: {{every: 100}}\ncheckpoint: {{every: 2}}\n"
                      f"data: {{kind: arrays, paths: {tmp_path / 'data.npz'}, batch_size: 64, "
                      f"shuffle: false}}\n")
    run_dir = tmp_path / "run"
    done = cli("train", "--config", str(config), "--run-dir", str(run_dir), "nonfinite=halt")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: step 5: loss or gradients are not"), \
        done.stderr
    # The checkpoints before the bad step are committed and nothing after it was saved.
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) == 4, saved
    records = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    assert records[5]["loss"] is None and max(records) < 12
    assert not (run_dir / "summary.json").exists()

    # And the run resumes from it under skip: steps 5 on run, the bad one counted.
    done = cli("train", "--config", str(config), "--run-dir", str(run_dir),
               "--allow-config-change")
    assert done.returncode == 0, done.stderr
    assert "resumed from step 4" in done.stdout
    final = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert final["step"] == 12 and final["nonfinite_steps"] == 1
    assert json.loads((run_dir / "summary.json").read_text())["final_loss"] > 0
