"""benchmarks/tpu_post_training.py at toy sizes on the CPU: its JSON holds the DPO step's
figures and both decoders', sane; the DPO step's first loss is ln 2 (fresh adapters leave the
policy its own reference); and the plain decode loop written there draws the same greedy
tokens as trainrun's rollouts from the same params, each of trainrun's tokens its greatest
logit."""

from __future__ import annotations

import argparse
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


class Clock:
    """Seconds that pass only where a test moves them on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.slow
@pytest.mark.parametrize("compiles_in_budget", [1.5, 3.0])
def test_a_dpo_compile_starts_only_after_the_last_batchs_row_and_within_the_budget(
        tmp_path, monkeypatch, compiles_in_budget):
    """Each DPO program's compile takes a long while here (a clock moved on by each compile,
    nothing else), the budget ``compiles_in_budget`` of them. The smallest batch compiles
    first and its row is on disk before the next batch's compile starts; that compile starts
    only where one as long as the first would end within the budget, else a note says why.
    Before, every batch's compile started at once, whatever the budget, and the part ran past
    its deadline."""
    import jax

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import tpu_post_training as bench

    compile_s = 1000.0
    clock = Clock()
    compiled = []  # (rows of a DPO step program, the rows on disk as its compile started)
    real_compile = jax.stages.Lowered.compile

    def compile_slowly(lowered, *args, **kwargs):
        taken = lowered.args_info[0]
        batch = taken[1] if len(taken) == 2 and isinstance(taken[1], dict) else {}
        if "tokens" in batch:
            saved = tmp_path / "tpu_post_training.json"
            on_disk = json.loads(saved.read_text()).get("dpo", {}).get("rows", [])
            compiled.append((batch["tokens"].shape[0], [row["batch"] for row in on_disk]))
            clock.now += compile_s
        return real_compile(lowered, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_slowly)
    args = argparse.Namespace(tiny=True, dpo_batches="", parts="dpo", dpo_set=[], rounds=2)
    budget = bench.Budget(compiles_in_budget * compile_s, 2, clock=clock)
    report = bench.Report(tmp_path)
    bench.run_parts(args, budget, report)
    rows = [row["batch"] for row in report.data["dpo"]["rows"]]
    smallest, larger = sorted(report.data["sizes"]["dpo_batches"])
    if compiles_in_budget < 2:
        assert compiled == [(smallest, [])] and rows == [smallest]
        assert budget.notes == [f"DPO @{larger} rows: not compiled: a compile took 1000 s here "
                                "(then 0 s to time it), 480 s are left"], budget.notes
    else:
        assert compiled == [(smallest, []), (larger, [smallest])] and rows == [smallest, larger]
        assert budget.notes == []
    assert json.loads((tmp_path / "tpu_post_training.json").read_text())["dpo"]["rows"]


@pytest.mark.slow
def test_at_the_deadline_the_report_is_written_and_the_process_ends(tmp_path):
    """A budget of a second ends the process at its deadline, in the middle of its first
    compiles: exit 2, the report written with a note saying so. Before, the budget was only
    consulted between parts, and a compile or a call under way ran on past it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tpu_post_training.py"), "--tiny", "--out",
         str(tmp_path), "--budget-s", "1"], capture_output=True, text=True, env=env,
        timeout=600)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tpu_post_training.json").read_text())
    assert report["notes"][-1].startswith("the time budget ran out"), report["notes"]
    assert "the time budget ran out" in (tmp_path / "tpu_post_training.md").read_text()
