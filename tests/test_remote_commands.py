"""The commands that read a run, on object storage (``gs://`` and ``s3://``, against the real
emulators of ``conftest.py``): a run trained here and uploaded in the layout Orbax's commit-file
mode gives (each committed step's folder holds its ``commit_success.txt``) reads back as the
local run does: report, compare, runs, verify-checkpoint, sample, ``trainrun.load``, export
(from a bucket and to one) and ``init.from``. Nothing makes a local folder named ``gs:`` or
``s3:``: each test runs in an empty working directory that must stay empty."""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import losses, upload_run

import trainrun
from trainrun import rundir
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.storage import location, remote

LOCK = "trainrun.lock"  # the local writer's lock file: not a file a run on a bucket has


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``mlp``: 4 steps, checkpoints 2 and 4. ``lm``: a 1-layer byte LM in GPT-2's layout, 1
    step (what `sample`, `export` and `load` read)."""
    root = tmp_path_factory.mktemp("trained")
    trainrun.run(load_config("mlp", ["steps=4", "checkpoint.every=2",
                                     "metrics.tensorboard=false"]), root / "mlp", out=io.StringIO())
    corpus = root / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 60)
    trainrun.run(load_config("lm", [*LM, f"data.paths=[{corpus}]", "steps=1"]), root / "lm",
                 out=io.StringIO())
    return root


LM = ["steps_per_call=1", "checkpoint.every=0", "eval.every=0",
      "optimizer.schedule.kind=constant", "model.d_model=16", "model.layers=1",
      "model.heads=2", "model.seq_len=16", "model.positions=learned", "model.bias=true",
      "data.seq_len=16", "data.batch_size=2", "metrics.tensorboard=false"]


def objects(url: location.Location) -> dict[str, bytes]:
    """Every object under ``url``: its name below it and its bytes."""
    return {name: (url / name).read_bytes() for name in url.list_tree()}


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """An empty working directory that stays empty: no path on object storage was taken for a
    local one (a folder named ``gs:`` or ``s3:``), nor anything else written here."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield work
    assert sorted(os.listdir(work)) == []


@pytest.mark.slow
def test_report_on_a_remote_run_writes_report_html_and_plots_there(bucket, trained, workdir,
                                                                    tmp_path, capsys):
    run = upload_run(trained / "mlp", f"{bucket}/runs/mlp")
    assert main(["report", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out == f"wrote {run / 'report.html'}\n" and err == "", (out, err)
    page = (run / "report.html").read_text()
    assert f"<p>{run}</p>" in page and "<h1>mlp</h1>" in page
    plots = re.findall(r'<img src="report/([^"]+)"', page)
    local = tmp_path / "mlp"
    shutil.copytree(trained / "mlp", local)
    assert main(["report", str(local)]) == 0
    capsys.readouterr()
    assert plots and sorted(plots) == sorted(p.name for p in (local / "report").iterdir())
    for name in plots:  # each plot the page shows is there, a whole PNG
        assert (run / "report" / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # the run's own files are as they were: the report only added its own
    assert {k: v for k, v in objects(run).items()
            if not k.startswith("report")} == {k: v for k, v in files(trained / "mlp").items()
                                               if k != LOCK}


def test_compare_a_remote_and_a_local_run_with_the_png_on_a_bucket(bucket, trained, workdir,
                                                                    capsys):
    run = upload_run(trained / "mlp", f"{bucket}/runs/mlp")
    out_png = location.location(f"{bucket}/plots/compare.png")
    assert main(["compare", str(run), str(trained / "mlp"), "--out", str(out_png)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.endswith(f"curves: {out_png}\n"), (out, err)
    rows = [line.split(None, 1) for line in out.splitlines()[1:3]]
    assert [r[0] for r in rows] == [str(run), str(trained / "mlp")]
    assert rows[0][1] == rows[1][1]  # status, step, final loss ...: the same run's
    assert out_png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_runs_lists_the_runs_under_a_remote_root_with_status_and_step(bucket, trained, workdir,
                                                                      capsys):
    from trainrun.reporting.report import list_runs

    for name in ("mlp", "lm"):
        upload_run(trained / name, f"{bucket}/runs/{name}")
    upload_run(trained / "mlp", f"{bucket}/runs/team/mlp")  # a run two levels down
    assert main(["runs", "--root", f"{bucket}/runs"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [
        ["lm", "finished", "1/1"], ["mlp", "finished", "4/4"], ["team/mlp", "finished", "4/4"]]
    local = list_runs(trained).splitlines()  # the same rows as the local runs'
    assert [line.split() for line in lines[:3]] == [line.split() for line in local]


def test_runs_on_a_bucket_lists_only_what_train_takes_for_a_run(bucket, trained, workdir,
                                                               tmp_path, monkeypatch, capsys):
    upload_run(trained / "mlp", f"{bucket}/runs/mlp")
    for key, text in (("alice", "name: alice\nitems: [1, 2]\n"), ("team/bob", "- 1\n- 2\n")):
        location.location(f"{bucket}/runs/{key}/config.yaml").write_text(text)
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["train", "--run-dir", f"{bucket}/runs/alice", "steps=1"]) == 2
    assert "is not a trainrun run directory" in capsys.readouterr().err  # train's own test
    assert main(["runs", "--root", f"{bucket}/runs"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and [line.split()[0] for line in out.splitlines()[1:]] == ["mlp"]


def test_verify_checkpoint_of_a_remote_run_passes_and_finds_a_changed_byte(bucket, trained,
                                                                          workdir, capsys):
    run = upload_run(trained / "mlp", f"{bucket}/runs/mlp")
    assert main(["verify-checkpoint", str(trained / "mlp")]) == 0
    local = capsys.readouterr().out
    assert main(["verify-checkpoint", str(run)]) == 0
    out = capsys.readouterr().out
    counted = re.search(r": (\d+ files, [\d,]+ bytes): every checksum matches\n$", local)
    assert counted and out == f"{run}/checkpoints/4: {counted.group(1)}: every checksum matches\n"
    # one byte flipped in an array file of the newest step, the object rewritten whole
    array = sorted(n for n in (run / "checkpoints/4").list_tree()
                   if n.startswith("state/ocdbt.process_0/d/"))[0]
    data = bytearray((run / "checkpoints/4" / array).read_bytes())
    data[len(data) // 2] ^= 0x01
    (run / "checkpoints/4" / array).write_bytes(bytes(data))
    assert main(["verify-checkpoint", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{run}/checkpoints/4: checksum mismatch in {array} (sha256 "), out
    assert main(["verify-checkpoint", str(run), "2"]) == 0  # the step before is whole
    assert "every checksum matches" in capsys.readouterr().out


@pytest.mark.slow
def test_sample_of_a_remote_run_is_the_local_runs_text(bucket, trained, workdir):
    from trainrun.evaluation.sample import sample_run

    run = upload_run(trained / "lm", f"{bucket}/runs/lm")
    for seed in (0, 7):
        assert sample_run(str(run), "the ", 12, seed=seed, temperature=0.8) == sample_run(
            trained / "lm", "the ", 12, seed=seed, temperature=0.8)


@pytest.mark.slow
def test_load_of_a_remote_run_gives_the_local_logits(bucket, trained, workdir):
    run = upload_run(trained / "lm", f"{bucket}/runs/lm")
    tokens = np.frombuffer(b"the quick brown", np.uint8).astype(np.int32)[None]
    here, there = trainrun.load(trained / "lm"), trainrun.load(str(run))
    assert there.step == here.step == 1
    np.testing.assert_array_equal(there.logits(tokens), here.logits(tokens))


@pytest.mark.slow
def test_a_step_without_its_commit_file_is_never_read(bucket, trained, workdir):
    """A step whose upload (or save) stopped before its commit file is a partial one: the
    reader takes the committed step before it."""
    from trainrun.checkpointing.reader import latest_state, saved_config

    run = upload_run(trained / "mlp", f"{bucket}/runs/mlp")
    (run / "checkpoints/4" / rundir.COMMIT_FILE).delete()
    step, _ = latest_state(run, saved_config(run))
    assert step == 2


@pytest.mark.slow
def test_export_of_a_remote_run_equals_the_local_export_file_for_file(bucket, trained, workdir,
                                                                      tmp_path):
    run = upload_run(trained / "lm", f"{bucket}/runs/lm")
    assert main(["export", str(run), "--to", str(tmp_path / "from-bucket")]) == 0
    assert main(["export", str(trained / "lm"), "--to", str(tmp_path / "from-disk")]) == 0
    there, here = files(tmp_path / "from-bucket"), files(tmp_path / "from-disk")
    assert sorted(there) == ["config.json", "model.safetensors"] and there == here


@pytest.mark.slow
def test_export_to_a_bucket_writes_its_mark_last_and_replaces_only_an_export(
        bucket, trained, workdir, tmp_path, capsys, monkeypatch):
    run = trained / "lm"
    assert main(["export", str(run), "--to", str(tmp_path / "local")]) == 0
    uploaded: list[str] = []
    put = remote.ObjectLocation.upload
    monkeypatch.setattr(remote.ObjectLocation, "upload", lambda path, local: (
        uploaded.append(path.name), put(path, local))[1])
    to = location.location(f"{bucket}/models/lm")
    assert main(["export", str(run), "--to", str(to)]) == 0
    assert objects(to) == files(tmp_path / "local") and uploaded[-1] == "config.json"
    capsys.readouterr()
    # again: refused without --replace, nothing changed
    assert main(["export", str(run), "--to", str(to)]) == 2
    assert "is not empty (it holds config.json, model.safetensors); pass --replace" in (
        capsys.readouterr().err)
    # --replace over an earlier export with a file this one does not write: exactly the new one
    (to / "generation_config.json").write_text('{"old": true}\n')
    (to / "config.json").write_text('{"old": true}\n')
    uploaded.clear()
    assert main(["export", str(run), "--to", str(to), "--replace"]) == 0
    assert objects(to) == files(tmp_path / "local") and uploaded[-1] == "config.json"
    # a prefix holding an object no export writes: refused, nothing deleted
    (to / "notes.txt").write_text("mine\n")
    before = objects(to)
    capsys.readouterr()
    assert main(["export", str(run), "--to", str(to), "--replace"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --to {to} holds notes.txt, which no export writes: it is not a model "
                   "directory, so --replace leaves it as it is; give a new or empty directory, "
                   "or an earlier export to replace\n")
    assert objects(to) == before


@pytest.mark.slow
def test_export_replace_is_refused_in_and_around_a_remote_run(bucket, trained, workdir, capsys):
    run = upload_run(trained / "lm", f"{bucket}/runs/lm")
    before = objects(run)
    for to, says in ((run / "hf", f"--to {run}/hf is inside the trainrun folder {run} (it has "
                                  "trainrun.json)"),
                     (run, f"--to {run} is the trainrun folder {run}"),
                     (run.parent, f"--to {run.parent} holds the run being exported ({run})")):
        assert main(["export", str(run), "--to", str(to), "--replace"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
    assert objects(run) == before


@pytest.mark.slow
def test_an_export_cut_short_on_a_bucket_has_no_mark_and_is_replaced_by_the_next(
        bucket, trained, workdir, tmp_path, monkeypatch):
    run = trained / "lm"
    to = location.location(f"{bucket}/models/lm")
    assert main(["export", str(run), "--to", str(to)]) == 0
    put = remote.ObjectLocation.upload

    def fail_on_the_mark(path: remote.ObjectLocation, local: Path) -> None:
        if path.name == "config.json":
            raise remote.StorageUnavailable(f"object storage did not answer writing {path}")
        put(path, local)

    monkeypatch.setattr(remote.ObjectLocation, "upload", fail_on_the_mark)
    assert main(["export", str(run), "--to", str(to), "--replace"]) == 1
    assert sorted(to.list_tree()) == ["model.safetensors"]  # no mark: not whole
    monkeypatch.setattr(remote.ObjectLocation, "upload", put)
    assert main(["export", str(run), "--to", str(to), "--replace"]) == 0
    assert main(["export", str(run), "--to", str(tmp_path / "local")]) == 0
    assert objects(to) == files(tmp_path / "local")


@pytest.mark.slow
def test_init_from_a_remote_run_trains_as_from_the_local_one(bucket, trained, workdir, tmp_path):
    source = upload_run(trained / "lm", f"{bucket}/runs/lm")
    corpus = trained / "corpus.txt"
    for name, origin in (("from-bucket", str(source)), ("from-disk", str(trained / "lm"))):
        config = load_config("lm", [*LM, f"data.paths=[{corpus}]", "steps=2",
                                    f"init.from={origin}"])
        trainrun.run(config, tmp_path / name, out=io.StringIO())
    np.testing.assert_array_equal(losses(tmp_path / "from-bucket"), losses(tmp_path / "from-disk"))
    saved = rundir.read_yaml(tmp_path / "from-bucket" / rundir.CONFIG)
    assert saved["init"]["from"] == str(source)
