"""The run directory: trainrun writes only into its own folders, one writer at a time; inputs
are refused before anything is created; a run killed at any moment is resumed or restarted by
the same command."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAULT_STACKS, cli_env, save_tiny_gpt2

from trainrun import rundir
from trainrun.cli import main as cli_main
from trainrun.config import load_config
from trainrun.errors import UserError
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.rundir.lock import RunDirLocked, RunLock, is_locked
from trainrun.training.loop import run
from trainrun.training.preemption import ABORT_EXIT_CODE

SMALL = ["steps=20", "checkpoint.every=10", "metrics.every=10", "metrics.tensorboard=false"]


def train(run_dir: Path, *overrides: str, **kwargs) -> str:
    out = io.StringIO()
    run(load_config("mlp", [*SMALL, *overrides]), run_dir, out=out, **kwargs)
    return out.getvalue()


def listing(path: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every folder (None), relative to ``path``."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


def cli(capfd, *args: str) -> tuple[int, str]:
    """``trainrun ARGS`` in this process: (exit status, what it printed on stderr and on
    the stdout of this moment; a run's console writes to the one it was imported with)."""
    code = cli_main(list(args))
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def steps_of(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / rundir.METRICS)]


def start(*args: str, stderr_to: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainrun", *args], stdout=subprocess.PIPE,
                            stderr=stderr_to.open("w"), text=True, env=cli_env(**env))


def wait_for_line(stream, text: str) -> None:
    seen = []
    for line in stream:
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"{text!r} never appeared in:\n{''.join(seen)[-3000:]}")


# ---- whose folder ----------------------------------------------------------------------------


@pytest.fixture
def user_folder(tmp_path) -> Path:
    """A folder of the user's own that happens to hold a config.yaml and a metrics.jsonl."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "config.yaml").write_text("lr: 3\n")
    (folder / "metrics.jsonl").write_text('{"mine": 1}\n')
    (folder / "status.json").write_text('{"status": "mine"}\n')
    return folder


@pytest.mark.parametrize("fresh", [False, True])
def test_a_users_folder_is_never_written_renamed_or_trimmed(tmp_path, capfd, user_folder,
                                                             fresh):
    before = listing(user_folder)
    code, err = cli(capfd, "train", "--run-dir", str(user_folder), *SMALL,
                    *(["--fresh"] if fresh else []))
    assert code == 2 and err.count("\n") == 1
    assert "is not a trainrun run directory" in err and "new or empty directory" in err
    assert ("--fresh moves only a trainrun run aside" in err) == fresh
    assert listing(user_folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]  # nothing moved aside


def test_fresh_moves_only_a_run_and_works_on_dot(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    train(run_dir)
    before = listing(run_dir)
    monkeypatch.chdir(run_dir)
    out = train(Path("."), fresh=True)  # `trainrun train --run-dir . --fresh`
    assert f"moved the previous run aside: {run_dir} -> {tmp_path}/run.old-" in out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and listing(aside[0]) == before  # moved whole, not into itself
    assert (run_dir / rundir.MARKER).is_file() and steps_of(run_dir) == list(range(1, 21))


def test_fresh_refuses_a_run_in_use(tmp_path, capfd):
    run_dir = tmp_path / "run"
    train(run_dir)
    holder = RunLock(run_dir)
    holder.acquire(create=True)
    holder.record_holder()
    try:
        before = listing(run_dir)
        code, err = cli(capfd, "train", "--run-dir", str(run_dir), "--fresh", *SMALL)
        assert code == 2 and err.count("\n") == 1
        assert f"is in use by another trainrun run (pid {os.getpid()} on host" in err
        assert listing(run_dir) == before
        assert [p.name for p in tmp_path.iterdir()] == ["run"]
    finally:
        holder.release()


def test_a_run_from_before_the_marker_resumes_and_is_marked(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir)
    (run_dir / rundir.MARKER).unlink()  # as an earlier trainrun left it
    (run_dir / "trainrun.lock").unlink()
    assert rundir.inspect(run_dir).kind == "legacy"
    out = train(run_dir, "steps=30")
    assert "written by an earlier trainrun: marked it" in out and "resumed from step 20" in out
    assert json.loads((run_dir / rundir.MARKER).read_text())["format"] == rundir.FORMAT
    assert steps_of(run_dir) == list(range(1, 31))


def test_a_newer_format_is_refused(tmp_path, capfd):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundir.MARKER).write_text(json.dumps({"format": rundir.FORMAT + 1}))
    before = listing(run_dir)
    code, err = cli(capfd, "train", "--run-dir", str(run_dir), *SMALL)
    assert code == 2 and "written by a newer trainrun" in err and listing(run_dir) == before


def test_checkpoint_dir_with_numbered_folders_of_someone_else_is_refused(tmp_path, capfd):
    other = tmp_path / "photos"
    for name in ("2024", "7"):
        (other / name).mkdir(parents=True)
        (other / name / "a.jpg").write_bytes(b"\xff\xd8")
    before = listing(other)
    code, err = cli(capfd, "train", "--run-dir", str(tmp_path / "run"), *SMALL,
                    f"checkpoint.dir={other}")
    assert code == 2 and err.count("\n") == 1
    assert "checkpoint.dir" in err and "not a trainrun checkpoint directory" in err
    assert "finished" not in err
    assert listing(other) == before and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_checkpoint_dir_kept_elsewhere_is_marked_locked_and_resumed(tmp_path):
    ckpt = tmp_path / "ckpts"
    train(tmp_path / "run", f"checkpoint.dir={ckpt}")
    assert json.loads((ckpt / rundir.MARKER).read_text())["holds"] == "checkpoints"
    assert rundir.committed_steps(ckpt) == [10, 20]
    out = train(tmp_path / "run", f"checkpoint.dir={ckpt}", "steps=30")
    assert "resumed from step 20" in out


# ---- one writer ------------------------------------------------------------------------------


def test_lock_names_its_holder_and_the_kernel_frees_it_on_kill(tmp_path):
    first = RunLock(tmp_path)
    first.acquire(create=True)
    first.record_holder()
    with pytest.raises(RunDirLocked, match=rf"pid {os.getpid()} on host "):
        RunLock(tmp_path).acquire(create=False)
    first.release()
    assert not is_locked(tmp_path) and (tmp_path / "trainrun.lock").read_text() == ""

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from trainrun.rundir.lock import RunLock\n"
        f"lock = RunLock(Path({str(tmp_path)!r})); lock.acquire(create=True)\n"
        "lock.record_holder(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, env=cli_env())
    assert holder.stdout.readline().strip() == "held"
    assert is_locked(tmp_path)
    holder.kill()  # SIGKILL: no clean-up code runs
    holder.wait()
    assert not is_locked(tmp_path)


@pytest.mark.slow
def test_a_second_train_on_a_running_directory_exits_2_at_once(tmp_path):
    run_dir = tmp_path / "run"
    first = start("train", "--run-dir", str(run_dir), "steps=10000000", "metrics.every=100",
                  "checkpoint.every=0", "metrics.tensorboard=false",
                  stderr_to=tmp_path / "first.txt", **FAULT_STACKS)
    try:
        wait_for_line(first.stdout, "step   ")
        began = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "trainrun", "train", "--run-dir",
                                 str(run_dir), "steps=10000000", "metrics.tensorboard=false"],
                                capture_output=True, text=True, timeout=120, env=cli_env())
        took = time.monotonic() - began
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
        assert f"is in use by another trainrun run (pid {first.pid} on host" in second.stderr
        assert "training" not in second.stdout
        del took  # not asserted (a shared machine), only that nothing was built or written
    finally:
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    # where a crash happened: its stacks (stderr), and how far the run had got (stdout's end)
    assert first.returncode == 0, ((tmp_path / "first.txt").read_text()[-3000:]
                                   + "\n--- stdout's end:\n" + out[-1500:])
    stopped = int(out.split("after step ")[1].split(":")[0])
    assert steps_of(run_dir) == list(range(1, stopped + 1))  # each step once
    assert rundir.read_status(run_dir)["status"] == "preempted"


def test_a_run_killed_after_its_last_checkpoint_is_recorded_finished_by_the_next_start(
        tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "steps=4", "checkpoint.every=2")
    status = json.loads((run_dir / rundir.STATUS).read_text())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    # as a process killed between committing step 4 and recording its end leaves it
    (run_dir / rundir.STATUS).write_text(json.dumps({**status, "status": "running",
                                                     "pid": int(dead.stdout)}))
    assert rundir.read_status(run_dir)["status"] == "failed"  # its process is gone
    out = train(run_dir, "steps=4", "checkpoint.every=2")
    assert "finished" in out
    assert rundir.read_status(run_dir)["status"] == "finished"
    assert rundir.read_status(run_dir)["step"] == 4


@pytest.mark.slow
def test_kill_9_at_any_moment_leaves_a_directory_the_same_command_finishes(tmp_path):
    run_dir = tmp_path / "run"
    command = ["train", "--run-dir", str(run_dir), "steps=60", "checkpoint.every=10",
               "metrics.every=10", "metrics.tensorboard=false"]
    for delay in (0.3, 0.9, 1.6, 2.4):  # start-up, marker and manager, first saves, training
        proc = start(*command, stderr_to=tmp_path / "killed.txt")
        time.sleep(delay)
        proc.kill()
        proc.communicate(timeout=60)
    done = subprocess.run([sys.executable, "-m", "trainrun", *command], capture_output=True,
                          text=True, timeout=300, env=cli_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps_of(run_dir) == list(range(1, 61))
    assert rundir.read_status(run_dir)["status"] == "finished"


@pytest.mark.slow
def test_second_ctrl_c_marks_the_run_failed(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "stderr.txt"
    proc = start("train", "--run-dir", str(run_dir), "steps=10000000", "metrics.every=100",
                 "checkpoint.every=0", "metrics.tensorboard=false", stderr_to=log,
                 **FAULT_STACKS)
    wait_for_line(proc.stdout, "step   ")
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while "SIGINT received" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == ABORT_EXIT_CODE, (log.read_text()[-8000:]
                                                + "\n--- stdout's end:\n" + out[-1500:])
    status = json.loads((run_dir / rundir.STATUS).read_text())
    assert status["status"] == "failed"
    assert status["reason"] == "aborted by a second SIGINT; no checkpoint was committed"


# ---- refused before anything is created ------------------------------------------------------


def test_a_directory_left_before_the_first_step_is_taken_over(tmp_path, capfd):
    left = tmp_path / "left"  # the marker and an empty checkpoints/: died in its first second
    (left / "checkpoints").mkdir(parents=True)
    (left / rundir.MARKER).write_text(json.dumps({"format": 1, "holds": "run"}))
    out = train(left)
    assert "taking over" in out and steps_of(left) == list(range(1, 21))

    old = tmp_path / "old"  # what an earlier trainrun left: only an empty checkpoints/
    (old / "checkpoints").mkdir(parents=True)
    assert "taking over" in train(old) and steps_of(old) == list(range(1, 21))


def write_config(path: Path, data: dict) -> Path:
    path.write_text(json.dumps({"steps": 5, "metrics": {"tensorboard": False}, "data": data}))
    return path


def refusals(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (train arguments, what the one line says), each a user's mistake."""
    np.savez(tmp_path / "named.npz", foo=np.zeros((64, 8), np.float32),
             bar=np.zeros((64, 1), np.float32))
    (tmp_path / "zero.npz").write_bytes(b"")
    (tmp_path / "latin1.yaml").write_bytes(b"steps: 5\nname: caf\xe9\n")
    (tmp_path / "empty.yaml").write_text("# nothing but a comment\n")
    (tmp_path / "no_text").mkdir()
    (tmp_path / "no_text" / "a.txt").write_text("")
    arrays = {"kind": "arrays", "batch_size": 16}
    return {
        "npz without the model's keys": (
            ["--config", str(write_config(tmp_path / "a.yaml",
                                          {**arrays, "paths": str(tmp_path / "named.npz")}))],
            "reads batch key 'x', which the data does not have"),
        "0-byte npz": (
            ["--config", str(write_config(tmp_path / "b.yaml",
                                          {**arrays, "paths": str(tmp_path / "zero.npz")}))],
            "cannot read"),
        "missing npz": (
            ["--config", str(write_config(tmp_path / "c.yaml",
                                          {**arrays, "paths": str(tmp_path / "gone.npz")}))],
            "not found"),
        "empty corpus": (
            ["--config", str(write_config(tmp_path / "d.yaml", {
                "kind": "text", "paths": [str(tmp_path / "no_text" / "*.txt")]})),
             "model.kind=transformer"],
            "is empty"),
        "batch larger than the data": (["data.batch_size=1000"], "larger than the train data"),
        "non-UTF-8 YAML": (["--config", str(tmp_path / "latin1.yaml")], "is not UTF-8 text"),
        "empty YAML": (["--config", str(tmp_path / "empty.yaml")], "is empty"),
    }


def test_each_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capfd):
    for name, (args, says) in refusals(tmp_path).items():
        run_dir = tmp_path / f"run-{len(name)}"
        code, err = cli(capfd, "train", "--run-dir", str(run_dir), *args)
        assert code == 2, (name, err)
        assert err.count("\n") == 1 and says in err, (name, err)
        assert not run_dir.exists(), name  # not even an empty folder to wedge the next try

    bad = tmp_path / os.fsdecode(b"run\xff")  # bytes a shell passes through as they are
    code, err = cli(capfd, "train", "--run-dir", str(bad), *SMALL)
    assert code == 2 and "is not valid UTF-8" in err and not bad.exists()


def test_refusals_in_an_existing_run_change_nothing(tmp_path, capfd):
    run_dir = tmp_path / "run"
    train(run_dir)
    before = listing(run_dir)
    code, err = cli(capfd, "train", "--run-dir", str(run_dir), *SMALL, "steps=30",
                    "data.batch_size=1000")
    assert code == 2 and "larger than the train data" in err and listing(run_dir) == before


def lm_args(tmp_path: Path, *extra: str) -> list[str]:
    """Train arguments for a tiny byte-level LM in GPT-2's layout, on a small corpus."""
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    return ["--config", "lm", "steps=2", "steps_per_call=1", "optimizer.schedule.warmup=1",
            "checkpoint.every=0", "eval.every=0", "metrics.tensorboard=false",
            "model.d_model=32", "model.layers=2", "model.heads=2", "model.seq_len=32",
            "model.positions=learned", "model.bias=true", f"data.paths=[{corpus}]",
            "data.seq_len=32", "data.batch_size=4", *extra]


@pytest.mark.slow
def test_init_from_that_does_not_fit_leaves_no_directory(tmp_path, capfd):
    pytest.importorskip("transformers", reason="the tests' extra holds transformers")
    mlp_run = tmp_path / "mlp-run"
    train(mlp_run)
    gpt2 = save_tiny_gpt2(tmp_path / "gpt2", vocab=256)
    capfd.readouterr()  # what saving it printed
    sources = {  # name -> (train arguments, what the one line says)
        "safetensors of the wrong shape": (
            lm_args(tmp_path, f"init.from={gpt2 / 'model.safetensors'}", "model.vocab=320"),
            "has shape (256, 32)"),
        "a run of another model kind": (
            lm_args(tmp_path, f"init.from={mlp_run}"), "has param 'b1'"),
        "GPT-2 of another width": (
            lm_args(tmp_path, f"init.from={gpt2}", "model.d_model=64"), "has n_embd 32"),
    }
    for name, (args, says) in sources.items():
        runs = tmp_path / f"runs-{len(name)}"  # neither it nor the run in it may be left
        code, err = cli(capfd, "train", "--run-dir", str(runs / "run"), *args)
        assert code == 2 and err.count("\n") == 1 and says in err, (name, err)
        assert not runs.exists(), (name, listing(runs))


def test_init_from_that_does_not_fit_leaves_an_existing_run_as_it_was(tmp_path, capfd):
    pytest.importorskip("safetensors", reason="the tests' extra holds safetensors")
    from safetensors.numpy import save_file

    save_file({"w1": np.zeros((8, 32), np.float32)}, str(tmp_path / "w.safetensors"))
    bad = f"init.from={tmp_path / 'w.safetensors'}"  # GPT-2 weights, for the MLP
    left = tmp_path / "left"  # a run refused before its first checkpoint, from an older trainrun
    (left / "checkpoints").mkdir(parents=True)
    run_dir = tmp_path / "run"
    train(run_dir)
    # a run with a checkpoint resumes from it (init.from is for a fresh start): --fresh only
    for folder, fresh in ((left, []), (left, ["--fresh"]), (run_dir, ["--fresh"])):
        before = listing(folder)
        code, err = cli(capfd, "train", "--run-dir", str(folder), *SMALL, bad, *fresh)
        assert code == 2 and err.count("\n") == 1 and "need model.kind=transformer" in err, err
        assert listing(folder) == before, (folder, fresh)
    # --fresh moved nothing aside, or moved it back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["left", "run", "w.safetensors"]


def test_withdraw_leaves_the_folders_as_the_claim_found_them(tmp_path):
    old = tmp_path / "old"  # a run --fresh moves aside
    (old / "checkpoints").mkdir(parents=True)
    (old / rundir.MARKER).write_text(json.dumps({"format": 1, "holds": "run"}))
    left = tmp_path / "left"  # what an earlier trainrun left: only an empty checkpoints/
    (left / "checkpoints").mkdir(parents=True)
    before = listing(tmp_path)
    claims = [rundir.RunDirectory(old, old / "checkpoints", fresh=True),
              rundir.RunDirectory(left, left / "checkpoints"),
              rundir.RunDirectory(tmp_path / "runs" / "new", tmp_path / "ckpts" / "a" / "b")]
    for directory in claims:
        directory.check()
        directory.claim()
        (directory.ckpt_dir / "1.orbax-checkpoint-tmp").mkdir(parents=True)  # a first save
    assert listing(tmp_path) != before
    for directory in claims:
        directory.withdraw()
        directory.release()
    assert listing(tmp_path) == before


def test_inspect_never_takes_a_users_folder_for_a_run(tmp_path):
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    (tmp_path / "status.json").write_text(json.dumps({"status": "running"}))  # not trainrun's
    assert rundir.inspect(tmp_path).kind == "foreign"
    with pytest.raises(UserError, match="is not a trainrun run directory"):
        rundir.RunDirectory(tmp_path, tmp_path / "checkpoints").check()


# ---- what a hostile input cannot do ----------------------------------------------------------


class Payload:
    """Unpickling it would create ``path``: the proof that a pickle was never loaded."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_code_in_yaml_or_a_pickle_in_npz_never_runs(tmp_path, capfd):
    ran = tmp_path / "ran"
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text(f"steps: 5\nname: !!python/object/apply:os.system ['touch {ran}']\n")
    code, err = cli(capfd, "train", "--config", str(tagged), "--run-dir", str(tmp_path / "a"))
    assert code == 2 and err.count("\n") == 1 and "is not valid YAML" in err

    np.savez(tmp_path / "pickled.npz", x=np.array([Payload(ran)] * 64, dtype=object),
             y=np.zeros((64, 1), np.float32))
    config = write_config(tmp_path / "p.yaml", {"kind": "arrays", "batch_size": 16,
                                                 "paths": str(tmp_path / "pickled.npz")})
    code, err = cli(capfd, "train", "--config", str(config), "--run-dir", str(tmp_path / "b"))
    assert code == 2 and err.count("\n") == 1 and "allow_pickle" in err
    assert not ran.exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_no_secret_from_the_environment_reaches_the_run_directory(tmp_path, monkeypatch):
    secret = "tr-secret-7c1f0e9a"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run_dir = tmp_path / "run"
    train(run_dir)
    assert not [name for name, data in listing(run_dir).items()
                if data is not None and secret.encode() in data]


def test_html_in_a_run_name_is_escaped_in_the_report(tmp_path, capfd):
    run_dir = tmp_path / "run"
    train(run_dir, "name=<img src=x onerror=alert(1)>")
    assert cli(capfd, "report", str(run_dir))[0] == 0
    page = (run_dir / "report.html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


@pytest.mark.parametrize("name", [rundir.METRICS, "trainrun.lock", rundir.STATUS])
def test_a_run_file_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path, capfd, name):
    """metrics.jsonl as a link was appended to through it, and trainrun.lock's target was
    truncated when the lock recorded its holder."""
    run_dir = tmp_path / "run"
    train(run_dir)
    elsewhere = tmp_path / "notes.txt"
    elsewhere.write_text("mine\n")
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).symlink_to(elsewhere)
    before = listing(run_dir)
    code, err = cli(capfd, "train", "--run-dir", str(run_dir), *SMALL, "steps=30")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run_dir / name} is a symbolic link" in err and "remove the link" in err
    assert elsewhere.read_text() == "mine\n" and listing(run_dir) == before
