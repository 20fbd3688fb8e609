"""What a user looks at: report.html and the PNGs it links, compare, and the runs listing."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import threading
import time

import numpy as np
import pytest
from PIL import Image

from trainrun import rundir
from trainrun.cli import main
from trainrun.config import config_from_dict, load_config
from trainrun.errors import UserCodeFailed
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run

QUICK = ["metrics.every=10", "checkpoint.every=0"]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """runs/finished (100 steps), runs/preempted (SIGTERM mid-run), runs/failed (its data
    raised); returns the root and the preempted run's result."""
    root = tmp_path_factory.mktemp("runs")
    rng = np.random.default_rng(0)
    for split, n in (("train", 512), ("eval", 256)):
        x = rng.normal(size=(n, 8)).astype(np.float32)
        np.savez(root / f"{split}.npz", x=x, y=x.sum(1, keepdims=True))
    with_eval = load_config("mlp", ["steps=100", *QUICK]).to_dict()
    with_eval["data"] = {"kind": "arrays", "paths": str(root / "train.npz"),
                         "eval_paths": str(root / "eval.npz"), "batch_size": 128}
    with_eval["eval"] = {"every": 25}
    run(config_from_dict(with_eval), root / "finished", out=io.StringIO())
    watcher = _preempt_when_running(root / "preempted")
    preempted = run(load_config("mlp", ["steps=1000000", "optimizer.lr=0.003", *QUICK]),
                    root / "preempted", out=io.StringIO())
    watcher.join()
    with pytest.raises(UserCodeFailed, match="data disk") as failed:
        run(load_config("mlp", ["steps=50", *QUICK]), root / "failed",
            data=_failing_batches(20), out=io.StringIO())
    assert isinstance(failed.value.__cause__, OSError)
    return root, preempted


@pytest.mark.slow
def test_report_writes_html_and_every_png_it_links(runs_root, capsys):
    root, _ = runs_root
    assert main(["report", str(root / "finished")]) == 0
    html_path = root / "finished" / "report.html"
    assert str(html_path) in capsys.readouterr().out
    page = html_path.read_text()
    linked = re.findall(r'<img src="([^"]+)"', page)
    names = {os.path.basename(src) for src in linked}
    assert "eval" in page and "best eval" in page
    assert {"train_and_eval_loss.png", "learning_rate.png", "gradient_global_norm.png",
            "throughput.png", "step_time_histogram.png", "wall_time_split.png"} <= names
    for src in linked:
        png = html_path.parent / src
        assert png.stat().st_size > 10_000, src  # a drawn plot, not an empty canvas
        with Image.open(png) as image:
            image.verify()
        with Image.open(png) as image:
            assert image.format == "PNG" and image.width >= 600 and image.height >= 300
            assert len(set(image.convert("L").getdata())) > 16  # lines and text, not one color
    summary = rundir.read_summary(root / "finished")
    assert f"{summary['final_loss']:.6g}" in page  # the summary table
    assert summary["provenance"]["jaxlib"] in page and "config_digest" in page  # provenance


def _preempt_when_running(run_dir):
    """SIGTERM this process once the run has started its loop, as a scheduler would."""
    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if rundir.read_status(run_dir).get("status") == "running":
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _failing_batches(good: int):
    x = np.ones((256, 8), np.float32)
    for _ in range(good):
        yield {"x": x, "y": x.sum(1, keepdims=True)}
    raise OSError("the data disk went away")


def test_runs_lists_finished_preempted_and_failed(runs_root, capsys):
    root, preempted = runs_root
    assert main(["runs", "--root", str(root)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert table[0].split()[:3] == ["run", "status", "step"]

    finished = read_metrics(root / "finished" / rundir.METRICS)
    assert rows["finished"][1:4] == ["finished", "100/100", f"{finished[-1]['loss']:.6g}"]
    evals = read_metrics(root / "finished" / rundir.METRICS, split="eval")
    assert [r["step"] for r in evals] == [25, 50, 75, 100]
    best = min(evals, key=lambda r: r["loss"])
    assert rows["finished"][4:8] == ["loss", f"{best['loss']:.6g}", "(step", f"{best['step']})"]
    stopped_at = preempted.preempted_at
    assert 0 < stopped_at < 1_000_000
    assert rows["preempted"][1:3] == ["preempted", f"{stopped_at}/1000000"]
    assert rows["failed"][1] == "failed"


def test_compare_overlays_runs_and_tables_final_metrics(runs_root, tmp_path, capsys):
    root, _ = runs_root
    png = tmp_path / "both.png"
    assert main(["compare", str(root / "finished"), str(root / "preempted"),
                 "--out", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("finished", "preempted"):
        final = read_metrics(root / name / rundir.METRICS)[-1]["loss"]
        [row] = [line for line in lines if line.startswith(name + " ")]
        assert f"{final:.6g}" in row.split()
    with Image.open(png) as image:
        assert image.width >= 1000 and len(set(image.convert("L").getdata())) > 16
    assert png.stat().st_size > 30_000


def test_report_of_a_path_without_a_run_is_a_one_line_error(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no trainrun run" in err
    assert main(["runs", "--root", str(tmp_path / "nowhere")]) == 2


def test_runs_flags_a_metrics_file_cut_short(runs_root, tmp_path, capsys):
    root, _ = runs_root
    copy = tmp_path / "runs"
    shutil.copytree(root / "finished", copy / "cut")
    metrics = copy / "cut" / rundir.METRICS
    lines = metrics.read_text().splitlines(keepends=True)
    kept = [json.loads(line) for line in lines[:40]]
    metrics.write_text("".join(lines[:40]) + lines[40][:12])  # cut in the middle of a line
    trained = len([r for r in kept if r.get("split", "train") == "train"])
    assert main(["runs", "--root", str(copy)]) == 0
    listing = capsys.readouterr().out
    assert f"[metrics.jsonl: 1 unreadable line, {100 - trained} steps without a row]" in listing


def someones_folders(root):
    """Folders holding a ``config.yaml`` trainrun did not write, one and two levels below
    ``root``: a mapping of other keys and a YAML list."""
    for folder, text in ((root / "alice", "name: alice\nitems: [1, 2]\n"),
                         (root / "team" / "bob", "- 1\n- 2\n")):
        folder.mkdir(parents=True)
        (folder / rundir.CONFIG).write_text(text)
    return [root / "alice", root / "team" / "bob"]


def test_runs_and_report_take_for_a_run_only_what_train_does(runs_root, tmp_path, capsys):
    root, _ = runs_root
    copy = tmp_path / "runs"
    shutil.copytree(root / "finished", copy / "finished")
    theirs = someones_folders(copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    assert [rundir.inspect(folder).kind for folder in theirs] == ["foreign", "foreign"]  # train
    assert main(["runs", "--root", str(copy)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[1:]] == ["finished"]
    for folder in theirs:
        assert main(["report", str(folder)]) == 2
        assert capsys.readouterr().err == (
            f"error: {folder} is not a trainrun run directory: its config.yaml is not one "
            "trainrun wrote (no trainrun.json beside it); give a run directory such as runs/mlp "
            "(`trainrun runs` lists them)\n")
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    (tmp_path / "empty").mkdir()  # an empty folder holds no runs: said, not refused
    assert main(["runs", "--root", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out == f"no runs under {tmp_path / 'empty'}\n"


def fresh_copy(run_dir, to):
    """A copy of a run directory without any report written into it."""
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns("report", "report.html"))
    return to


@pytest.mark.slow
def test_report_and_compare_replace_a_link_and_never_write_through_it(runs_root, tmp_path,
                                                                      capsys):
    """Before, a report.html, a plot in report/ or a compare --out that was a link to a file
    elsewhere had that file overwritten."""
    root, _ = runs_root
    run_dir = fresh_copy(root / "finished", tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("notes.html", "plot.png", "figure.png"):
        (elsewhere / name).write_text(f"mine: {name}\n")
    (run_dir / "report.html").symlink_to(elsewhere / "notes.html")
    (run_dir / "report").mkdir()
    (run_dir / "report" / "learning_rate.png").symlink_to(elsewhere / "plot.png")
    (tmp_path / "compare.png").symlink_to(elsewhere / "figure.png")
    assert main(["report", str(run_dir)]) == 0
    assert main(["compare", str(run_dir), "--out", str(tmp_path / "compare.png")]) == 0
    assert {p.name: p.read_text() for p in elsewhere.iterdir()} == {
        name: f"mine: {name}\n" for name in ("notes.html", "plot.png", "figure.png")}
    written = [run_dir / "report.html", run_dir / "report" / "learning_rate.png",
               tmp_path / "compare.png"]
    assert not any(p.is_symlink() for p in written)
    assert "<h2>Plots</h2>" in written[0].read_text()
    for png in written[1:]:
        with Image.open(png) as image:
            assert image.format == "PNG"
    capsys.readouterr()


def test_report_refuses_a_plot_folder_that_is_a_link(runs_root, tmp_path, capsys):
    """Before, the plots were written into whatever folder report/ linked to."""
    root, _ = runs_root
    run_dir = fresh_copy(root / "finished", tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "report").symlink_to(elsewhere)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {run_dir}/report is a symbolic link (to {elsewhere}), not the folder "
                   "trainrun report writes its plots in; remove the link (what it points to is "
                   "left alone) and run the report again\n")
    assert list(elsewhere.iterdir()) == [] and not (run_dir / "report.html").exists()
