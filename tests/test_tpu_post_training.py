"""benchmarks/tpu_post_training.py at toy sizes on the CPU: its JSON holds the DPO step's
figures and both decoders', sane; the DPO step's first loss is ln 2 (fresh adapters leave the
policy its own reference); and the plain decode loop written there draws the same greedy
tokens as trainrun's rollouts from the same params, each of trainrun's tokens its greatest
logit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_post_training_benchmark_at_toy_sizes_reports_dpo_and_equal_greedy_decoding(
        tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tpu_post_training.py"), "--tiny", "--out",
         str(tmp_path), "--rounds", "2", "--compile-threads", "2", "--budget-s", "3000"],
        capture_output=True, text=True, env=env, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tpu_post_training.json").read_text())
    assert report["notes"] == [], report["notes"]  # nothing failed or was skipped
    assert "## DPO with LoRA" in done.stdout and "Greedy check" in done.stdout

    dpo = report["dpo"]
    assert 0 < dpo["trainable"] < dpo["params"]
    rows = {row["batch"]: row for row in dpo["rows"]}
    assert set(rows) == set(report["sizes"]["dpo_batches"])
    for row in rows.values():
        assert row["step_ms"] > 0 and row["rounds"] >= 2 and row["compile_s"] > 0
        assert row["tokens_per_s"] >= row["real_tokens_per_s"] > 0
        assert row["pairs"] == row["pairs_metric"] >= row["batch"]
        assert row["memory"]["need"] > row["memory"]["argument"] > 0
        # the reference's forward pass and the adapters' gradients beyond a full 6N count
        assert row["flops_model"] > row["flops_6n"] > 0 and 0 < row["mfu_model"] < 1
        assert row["flops_trainrun"] > 0
        assert abs(row["first_loss"] - math.log(2)) < 1e-3

    decode = {row["name"]: row for row in report["decode"]["rows"]}
    assert set(decode) == {"trainrun", "plain"}
    sizes = report["sizes"]
    for row in decode.values():
        assert row["rows"] == sizes["prompts"] * sizes["group"] and row["new"] == sizes["new"]
        assert row["tokens_per_s"] > 0 and row["rounds"] >= 2

    check = report["greedy_check"]
    assert check["rows"] == sizes["prompts"] and check["steps"] == sizes["prompts"] * sizes["new"]
    assert check["same_tokens"] and check["rows_equal"] == check["rows"], check
    assert check["forced_steps_not_greedy"] == 0 and check["forced_max_gap"] == 0.0, check
