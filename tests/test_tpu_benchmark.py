"""benchmarks/tpu_step.py at toy sizes on the CPU: it runs, and its JSON holds both shapes'
figures, sane, with the plain step and trainrun's step computing the same losses from the
same params; no compile ran beside a timing; the head's and attention's paths compute what
the plain ones do; the state at step 0 made op by op has the init program's bits."""

from __future__ import annotations

import gzip
import importlib.util
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
         str(tmp_path), "--parts", "micro,init,gpt2,qwen", "--rounds", "2", "--compile-threads",
         "2", "--budget-s", "3000", "--gpt2-extra", "select,none+chunk=64",
         "--gpt2-attention", "library",
         # the head as trainrun chooses it on a TPU, not as the micro part's CPU timings do
         "--gpt2-head", "library", "--qwen-attention", "splash", "--compile-profile", "6"],
        capture_output=True, text=True, env=env, timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tpu_step.json").read_text())
    assert not report["notes"], report["notes"]  # nothing failed or was skipped
    assert "| plain: plain JAX" in done.stdout and "### The head's loss" in done.stdout

    micro = report["micro"]
    assert {(r["shape"], r["kind"]) for r in micro} == {
        (shape, kind) for shape in ("gpt2", "qwen") for kind in ("head", "attention")}
    assert all("failed" not in r and r["ok"] and r["ms"] > 0 for r in micro), micro
    names = {r["name"] for r in micro}
    assert any(n.startswith("unrolled") for n in names) and any("splash" in n for n in names)

    # the state at step 0: op by op it is trainrun's init program's bits, as state.py says
    init = {(r["shape"], r["how"]): r for r in report["init"]}
    assert {shape for shape, _ in init} == {"gpt2-tiny", "qwen-tiny"} and len(init) == 6
    for shape in ("gpt2-tiny", "qwen-tiny"):
        assert init[shape, "op by op"]["same_bits"], init
        assert init[shape, "trainrun's init program"]["compile_s"] > 0

    # the two main programs compiled alone, before any other, each under the profiler: the
    # compiler's costliest host events, and the program they name kept beside them
    assert set(report["compile_alone_s"]) == {"plain", "trainrun"}
    assert set(report["compile_events"]) == {"plain", "trainrun"}
    for name, events in report["compile_events"].items():
        assert 0 < len(events) <= 12 and all(
            e["total_s"] >= e["self_s"] >= 0 and e["count"] > 0 for e in events), events
        with gzip.open(tmp_path / f"{name}.hlo.txt.gz", "rt") as handle:
            assert handle.read().startswith("HloModule")
    assert "#### The compile's host events: trainrun" in done.stdout
    # the compile cache's write and read, step by step, of each program compiled alone
    trips = report["cache_round_trip"]
    assert set(trips) == {"plain", "trainrun"}
    assert all(t["raw_mb"] > t["mb"] > 0 and t["load_s"] > 0 for t in trips.values()), trips
    gpt2 = report["gpt2"]
    assert set(gpt2) == {"2", "3", "4"}  # 4: trainrun alone, past the plain step's largest
    first = {r["name"]: r for r in gpt2["2"]["rows"]}
    assert set(first) == {"plain", "trainrun", "trainrun, guard a select",
                          "trainrun, none + chunk=64"}
    both = first["trainrun, none + chunk=64"]["what"]  # an extra of two changes
    assert "loss_chunk=64" in both and "no non-finite guard" in both, both
    assert first["trainrun"]["compiled_alone"] and first["plain"]["compiled_alone"]
    assert "splash" in first["trainrun"]["what"] and "head unrolled" in first["trainrun"]["what"]
    assert {r["name"] for r in gpt2["3"]["rows"]} == {"plain", "trainrun"}
    assert [r["name"] for r in gpt2["4"]["rows"]] == ["trainrun"]
    qwen = report["qwen"]["rows"]
    for row in [*first.values(), *gpt2["3"]["rows"], *qwen]:
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["rounds"] >= 2
        assert 0 < row["mfu_datasheet"] < 1 and row["compile_s"] > 0
        assert row["memory"]["need"] > row["memory"]["argument"] > 0
        assert all(math.isfinite(x) and x > 1.0 for x in row["first_losses"])
    # the same params, tokens and maths: step 0's losses agree to rounding, guard or not
    for rows in ("2", "3"):
        checks = gpt2[rows]["checks"]
        assert checks and all(check["ok"] for check in checks.values()), checks
    assert first["trainrun"]["first_losses"] == first["trainrun, guard a select"]["first_losses"]

    # the 0.5B shape: trainrun at the largest size that runs, the plain step at the first
    # that fits, then trainrun without its guard at the target rows; trainrun's smaller sizes
    # compiled ahead but not run, the sizes not needed never compiled
    assert sorted((r["name"], r["rows"], r["k"]) for r in qwen) == [
        ("plain", 1, 2), ("plain, layers rematerialized", 2, 2), ("trainrun", 4, 2),
        ("trainrun, no guard", 2, 2)]
    fit = {f["side"]: (f["compile"], f["first_call"]) for f in report["qwen"]["fit"]}
    assert fit == {
        "qwen-tiny: trainrun @4x2": ("ok", "ok"),
        "qwen-tiny: trainrun @2x2": ("ok", "not tried"),
        "qwen-tiny: trainrun @1x2": ("not compiled", "not tried"),
        "qwen-tiny: trainrun, no guard @2x2": ("ok", "ok"),
        "qwen-tiny: plain @1x2": ("ok", "ok"), "qwen-tiny: plain @1x1": ("not compiled",
                                                                         "not tried"),
        "qwen-tiny: plain, layers rematerialized @2x2": ("ok", "ok"),
        "qwen-tiny: plain, layers rematerialized @1x2": ("not compiled", "not tried")}
    assert "splash" in qwen[0]["what"] and "scan_layers=True, remat=full" in qwen[0]["what"]
    assert report["verdicts"][-1].startswith("qwen-tiny: trainrun ran 512 tokens a step")
    assert any(v.startswith("gpt2-tiny, each at its largest batch (trainrun 4 rows, plain 3)")
               for v in report["verdicts"])


def test_the_compiles_host_events_are_summed_by_self_time_and_name_their_instruction(
        tmp_path, monkeypatch):
    """``--compile-profile``'s reading of a trace: an event's self time is its own less what
    nests in it on its thread, a device's events are left out, and an emission names its
    instruction's shape and JAX operation in the compiled program."""
    spec = importlib.util.spec_from_file_location("tpu_step", REPO / "benchmarks" / "tpu_step.py")
    assert spec is not None and spec.loader is not None
    tpu_step = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "tpu_step", tpu_step)  # its dataclasses look it up
    spec.loader.exec_module(tpu_step)
    hlo = ('  %reshape.71 = f32[38633472]{0} reshape(%fusion.5), metadata={op_name='
           '"jit(multi_step)/while/body/closed_call/reshape"}\n')
    emit = "XLA::TPU emitting for reshape.71"
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:TPU:0"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 10_000_000, "name": "TpuCompiler"},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 1_000_000, "dur": 4_000_000, "name": emit},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 2_000_000, "dur": 1_000_000, "name": "LSRA"},
        {"ph": "X", "pid": 1, "tid": 2, "ts": 0, "dur": 3_000_000, "name": "LSRA"},
        {"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 9_000_000, "name": "TpuCompiler"}]
    (tmp_path / "t").mkdir()
    with gzip.open(tmp_path / "t" / "host.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    found = {e["name"]: e for e in tpu_step.host_events(str(tmp_path), 5, hlo)}
    assert [found[n]["self_s"] for n in ("TpuCompiler", emit, "LSRA")] == [6.0, 3.0, 4.0]
    assert found["TpuCompiler"]["total_s"] == 10.0 and found["LSRA"]["count"] == 2
    assert found[emit]["instruction"] == (
        "f32[38633472]{0} reshape from while/body/closed_call/reshape")
    assert found["kind: XLA::TPU emitting for reshape.*"]["self_s"] == 3.0
