"""benchmarks/tpu_step.py at toy sizes on the CPU: it runs, and its JSON holds both shapes'
figures, sane, with the plain step and trainrun's step computing the same losses from the
same params; the head's and attention's paths compute what the plain ones do."""

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
def test_the_tpu_benchmark_at_toy_sizes_reports_both_shapes_and_equal_losses(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tpu_step.py"), "--tiny", "--out",
         str(tmp_path), "--parts", "micro,gpt2,qwen", "--rounds", "2", "--compile-threads",
         "2", "--budget-s", "3000"], capture_output=True, text=True, env=env, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tpu_step.json").read_text())
    # nothing failed or was skipped (a busy machine may only say its compiles did not overlap)
    assert not [n for n in report["notes"] if "did not overlap" not in n], report["notes"]
    assert "| plain: plain JAX" in done.stdout and "### The head's loss" in done.stdout

    micro = report["micro"]
    assert {(r["shape"], r["kind"]) for r in micro} == {
        (shape, kind) for shape in ("gpt2", "qwen") for kind in ("head", "attention")}
    assert all("failed" not in r and r["ok"] and r["ms"] > 0 for r in micro), micro
    names = {r["name"] for r in micro}
    assert any(n.startswith("fused fwd") for n in names) and any("splash" in n for n in names)

    gpt2 = {r["name"]: r for r in report["gpt2"]["rows"]}
    assert {"plain", "trainrun", "trainrun tuned"} <= set(gpt2)
    for row in [*gpt2.values(), *report["qwen"]["rows"]]:
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["rounds"] >= 2
        assert 0 < row["mfu_datasheet"] < 1 and row["compile_s"] > 0
        assert row["memory"]["need"] > row["memory"]["argument"] > 0
        assert all(math.isfinite(x) and x > 1.0 for x in row["first_losses"])
    # the same params, tokens and maths: step 0's losses agree to rounding
    checks = report["gpt2"]["checks"]
    assert all(check["ok"] for check in checks.values()), checks
    first = {name: row["first_losses"][0] for name, row in gpt2.items()}
    assert abs(first["plain"] - first["trainrun"]) < 1e-3 < abs(first["plain"] - 1.0)

    qwen = {r["name"]: r for r in report["qwen"]["rows"]}
    assert {"plain", "trainrun tuned"} <= set(qwen)
    for name, found in report["qwen"]["search"].items():
        assert found["largest"] == qwen[name]["batch"]
        assert max(found["needs_gib"].values()) > 0
