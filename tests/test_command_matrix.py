"""Every command against bad paths, damaged run files and a hostile environment: one line that
names the problem and the fix, exit 2 for input and 1 for the environment, nothing of the user's
changed, no folder made that was not there, and no absl, Orbax, JAX or matplotlib log line.

One table, run in-process on copies of two tiny trained runs (an MLP, and a GPT-2-shaped LM
that `sample` and `export` take); the environment's cases run each variable once in a
subprocess, every command in it (JAX's backend and matplotlib read them once per process)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import cli_env

import trainrun
from trainrun.cli import main
from trainrun.config import load_config

ROOT = os.geteuid() == 0  # root reads and writes through any mode bits
LOGGERS = ("absl", "orbax", "jax", "matplotlib")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``mlp``: 4 steps, checkpoints 2 and 4. ``lm``: a 1-layer byte LM in GPT-2's layout
    (learned positions, biases), 1 step: what `sample`, `export` and `load` read."""
    root = tmp_path_factory.mktemp("trained")
    trainrun.run(load_config("mlp", ["steps=4", "checkpoint.every=2",
                                     "metrics.tensorboard=false"]), root / "mlp", out=io.StringIO())
    corpus = root / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog.\n" * 60)
    trainrun.run(load_config("lm", [
        "steps=1", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.kind=constant", "model.d_model=16", "model.layers=1",
        "model.heads=2", "model.seq_len=16", "model.positions=learned", "model.bias=true",
        f"data.paths=[{corpus}]", "data.seq_len=16", "data.batch_size=2",
        "metrics.tensorboard=false"]), root / "lm", out=io.StringIO())
    return root


class Sandbox:
    """A test's folder: copies of the trained runs made on first use, and the paths the table
    names. The command may change nothing in it (but for a case's declared outputs)."""

    def __init__(self, tmp: Path, trained: Path):
        self.tmp, self.trained = tmp, trained
        self.missing = tmp / "missing"
        self.long = tmp / ("x" * 300)
        self.deep = Path("/".join([str(tmp)] + ["y" * 200] * 22))

    def copy(self, name: str) -> Path:
        target = self.tmp / name
        if not target.exists():
            shutil.copytree(self.trained / name, target)
        return target

    @property
    def mlp(self) -> Path:
        return self.copy("mlp")

    @property
    def lm(self) -> Path:
        return self.copy("lm")

    def file(self, name: str = "a-file", text: str = "mine\n") -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    def folder(self, name: str = "not-a-run", holding: str | None = "notes.txt") -> Path:
        path = self.tmp / name
        path.mkdir(exist_ok=True)
        if holding:
            (path / holding).write_text("not a run\n")
        return path

    def loop(self) -> Path:
        path = self.tmp / "loop"
        path.symlink_to(path)
        return path

    def link_to_run(self) -> Path:
        path = self.tmp / "link"
        path.symlink_to(self.mlp)
        return path

    def project(self) -> Path:
        """A user's folder with a config.json of theirs beside sources and a thesis."""
        path = self.folder("myproject", "thesis.txt")
        (path / "config.json").write_text('{"mine": true}\n')
        (path / "src").mkdir()
        return path

    def run_in_project(self) -> Path:
        """A copy of the LM run inside ``proj/`` (``proj/runs/lm``), beside a config.json."""
        project = self.folder("proj", "config.json")
        shutil.copytree(self.trained / "lm", project / "runs" / "lm")
        return project / "runs" / "lm"

    def plots_linked(self) -> Path:
        """A copy of the MLP run whose ``report/`` is a link to a folder elsewhere."""
        (self.mlp / "report").symlink_to(self.folder("elsewhere", None))
        return self.mlp

    def garbage(self, run: str, relative: str) -> Path:
        """A copy of ``run`` with the file at ``relative`` (a glob) replaced by random bytes."""
        path = self.copy(run)
        (target,) = sorted(path.glob(relative))[-1:]
        target.write_bytes(os.urandom(4096))
        return path

    def unreadable(self, path: Path) -> Path:
        path.chmod(0)
        return path

    def read_only(self, path: Path) -> Path:
        """``path`` (a folder) unwritable: a read-only tmpfs as root, mode bits otherwise."""
        if not ROOT:
            for p in [path, *path.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)
            return path
        mount = self.tmp / "ro"
        mount.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"a read-only folder as root needs a tmpfs mount: {done.stderr.strip()}")
        self.mounted = mount
        shutil.copytree(path, mount / path.name)
        shutil.rmtree(path)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        return mount / path.name


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Sandbox], list[str]]
    code: int
    says: str  # a regular expression the one line matches
    stream: str = "err"  # where the one line goes: err (error/warning) or out (a verdict)
    writes: str | None = None  # a glob, under the sandbox, of what the command may write
    unreadable: bool = False  # needs mode bits that bind (not root)


RO = r"read-only file system|permission denied"
CASES = [
    # ---- report RUN_DIR ----
    Case("report-missing", lambda s: ["report", str(s.missing)], 2, "holds no trainrun run"),
    Case("report-file", lambda s: ["report", str(s.file())], 2, "holds no trainrun run"),
    Case("report-foreign-folder", lambda s: ["report", str(s.folder())], 2,
         "holds no trainrun run"),
    Case("report-too-long", lambda s: ["report", str(s.long)], 2, "too long for the file sys"),
    Case("report-too-deep", lambda s: ["report", str(s.deep)], 2, "too long for the file sys"),
    Case("report-symlink-loop", lambda s: ["report", str(s.loop())], 2, "holds no trainrun"),
    Case("report-garbage-config", lambda s: ["report", str(s.garbage("mlp", "config.yaml"))],
         2, r"config\.yaml is damaged \(not UTF-8.*restore it"),
    Case("report-garbage-summary", lambda s: ["report", str(s.garbage("mlp", "summary.json"))],
         2, r"summary\.json is damaged"),
    Case("report-garbage-metrics", lambda s: ["report", str(s.garbage("mlp", "metrics.jsonl"))],
         0, r"^warning: .*metrics\.jsonl: \d+ unreadable lines; plotted without them",
         writes="mlp/report*"),
    Case("report-plot-folder-a-link", lambda s: ["report", str(s.plots_linked())], 2,
         r"mlp/report is a symbolic link \(to .*elsewhere\), not the folder .*remove the link"),
    Case("report-read-only", lambda s: ["report", str(s.read_only(s.mlp))], 1, RO),
    Case("report-unreadable", lambda s: ["report", str(s.unreadable(s.mlp))], 1,
         "permission denied", unreadable=True),
    # ---- sample RUN_DIR ----
    Case("sample-missing", lambda s: ["sample", str(s.missing)], 2, "is not a run directory"),
    Case("sample-foreign-folder", lambda s: ["sample", str(s.folder())], 2, "not a run dir"),
    Case("sample-too-long", lambda s: ["sample", str(s.long)], 2, "too long for the file sys"),
    Case("sample-an-mlp-run", lambda s: ["sample", str(s.mlp)], 2,
         "sampling needs a language model"),
    Case("sample-garbage-config", lambda s: ["sample", str(s.garbage("lm", "config.yaml"))],
         2, r"config\.yaml is damaged"),
    Case("sample-garbage-array", lambda s: [
        "sample", str(s.garbage("lm", "checkpoints/1/state/ocdbt.process_0/d/*"))], 2,
        r"no checkpoint in .* can be read \(step 1: .* has 4096 bytes.*restore its files"),
    Case("sample-garbage-step-record", lambda s: [
        "sample", str(s.garbage("lm", "checkpoints/1/_CHECKPOINT_METADATA")), "--tokens", "3"],
        0, ".", stream="out"),  # the record is not needed: sampled, no absl line
    Case("sample-unreadable", lambda s: ["sample", str(s.unreadable(s.lm))], 1,
         "permission denied", unreadable=True),
    # ---- export RUN_DIR --to DIR ----
    Case("export-missing", lambda s: ["export", str(s.missing), "--to", str(s.tmp / "out")],
         2, "is not a run directory"),
    Case("export-an-mlp-run", lambda s: ["export", str(s.mlp), "--to", str(s.tmp / "out")],
         2, "export writes transformers"),
    Case("export-to-a-file", lambda s: ["export", str(s.lm), "--to", str(s.file())], 2,
         "is a file, not a directory"),
    Case("export-replace-a-users-folder", lambda s: [
        "export", str(s.lm), "--to", str(s.project()), "--replace"], 2,
        r"--to .*myproject holds src/, thesis\.txt, which no export writes: it is not a model"),
    Case("export-replace-the-folder-holding-the-run", lambda s: [
        "export", str(s.run_in_project()), "--to", str(s.tmp / "proj"), "--replace"], 2,
        r"--to .*proj holds the run being exported \(.*proj/runs/lm\); --replace never"),
    Case("export-into-the-run", lambda s: ["export", str(s.lm), "--to", str(s.lm / "hf")], 2,
         r"--to .*lm/hf is inside the trainrun folder .*lm \(it has trainrun\.json\)"),
    Case("export-to-too-long", lambda s: ["export", str(s.lm), "--to", str(s.long)], 2,
         "too long for the file system"),
    Case("export-to-read-only", lambda s: [
        "export", str(s.lm), "--to", str(s.read_only(s.folder("dest", None)) / "out")], 1, RO),
    Case("export-unsupported-shard-size", lambda s: [
        "export", str(s.lm), "--to", str(s.tmp / "out"), "--shard-size", "lots"], 2,
        "is not a size"),
    Case("export-garbage-checksums", lambda s: [
        "export", str(s.garbage("lm", "checkpoints/1/state/trainrun-checksums.json")), "--to",
        str(s.tmp / "out")], 2, r"checksums\.json cannot be read"),
    # ---- verify-checkpoint RUN_DIR [STEP] ----
    Case("verify-checkpoint-missing", lambda s: ["verify-checkpoint", str(s.missing)], 2,
         "holds no trainrun run"),
    Case("verify-checkpoint-too-long", lambda s: ["verify-checkpoint", str(s.long)], 2,
         "too long for the file system"),
    Case("verify-checkpoint-garbage-config", lambda s: [
        "verify-checkpoint", str(s.garbage("mlp", "config.yaml"))], 2, "config.yaml is damaged"),
    Case("verify-checkpoint-garbage-array", lambda s: [
        "verify-checkpoint", str(s.garbage("mlp", "checkpoints/4/state/d/*"))], 1,
        "has 4096 bytes, .* when saved", stream="out"),
    Case("verify-checkpoint-no-such-step", lambda s: ["verify-checkpoint", str(s.mlp), "7"], 2,
         "has no checkpoint of step 7; its steps: 2, 4"),
    # ---- compare RUN_DIR... --out FILE ----
    Case("compare-missing", lambda s: ["compare", str(s.missing), "--out", str(s.tmp / "c.png")],
         2, "holds no trainrun run"),
    Case("compare-unsupported-format", lambda s: [
        "compare", str(s.mlp), "--out", str(s.tmp / "c.txt")], 2, "matplotlib writes no .txt"),
    Case("compare-out-too-long", lambda s: [
        "compare", str(s.mlp), "--out", str(s.tmp / ("c" * 300 + ".png"))], 2,
        "too long for the file system"),
    Case("compare-out-read-only", lambda s: [
        "compare", str(s.mlp), "--out", str(s.read_only(s.folder("dest", None)) / "c.png")],
        1, "cannot write .*(Read-only file system|Permission denied)"),
    Case("compare-garbage-summary", lambda s: [
        "compare", str(s.garbage("mlp", "summary.json")), "--out", str(s.tmp / "c.png")], 2,
        "summary.json is damaged"),
    # ---- runs --root DIR ----
    Case("runs-missing", lambda s: ["runs", "--root", str(s.missing)], 2, "no runs directory"),
    Case("runs-a-file", lambda s: ["runs", "--root", str(s.file())], 2, "no runs directory"),
    Case("runs-too-long", lambda s: ["runs", "--root", str(s.long)], 2, "too long for the file"),
    Case("runs-a-damaged-run-among-good-ones", lambda s: [
        "runs", "--root", str(s.lm.parent), str(s.garbage("mlp", "config.yaml"))][:3], 0,
        r"(?s)lm +finished .*mlp +unreadable \(config\.yaml is damaged\)", stream="out"),
    # ---- verify-resume ----
    Case("verify-resume-work-dir-a-file", lambda s: [
        "verify-resume", "--work-dir", str(s.file()), "steps=4"], 2, "is a file"),
    Case("verify-resume-work-dir-not-empty", lambda s: [
        "verify-resume", "--work-dir", str(s.folder()), "steps=4"], 2, "is not empty"),
    Case("verify-resume-work-dir-too-long", lambda s: [
        "verify-resume", "--work-dir", str(s.long), "steps=4"], 2, "too long for the file"),
    Case("verify-resume-work-dir-read-only", lambda s: [
        "verify-resume", "--work-dir", str(s.read_only(s.folder("dest", None)) / "w"),
        "steps=4"], 1, RO),
    Case("verify-resume-garbage-config", lambda s: [
        "verify-resume", "--config", str(s.garbage("mlp", "config.yaml") / "config.yaml")], 2,
        "is not UTF-8 text"),
    Case("verify-resume-kill-past-the-end", lambda s: [
        "verify-resume", "--kill-at", "99", "steps=4"], 2, "is not a checkpoint before the end"),
    # ---- config show ----
    Case("config-show-missing", lambda s: ["config", "show", "--config", str(s.missing)], 2,
         "not found"),
    Case("config-show-a-folder", lambda s: ["config", "show", "--config", str(s.folder())], 2,
         "is a folder, not a YAML file"),
    Case("config-show-garbage", lambda s: [
        "config", "show", "--config", str(s.garbage("mlp", "config.yaml") / "config.yaml")], 2,
        "is not UTF-8 text"),
    Case("config-show-not-yaml", lambda s: [
        "config", "show", "--config", str(s.file("bad.yaml", "steps: [1, 2\n"))], 2,
        "is not valid YAML"),
    Case("config-show-too-long", lambda s: ["config", "show", "--config", str(s.long)], 2,
         "too long for the file system"),
    Case("config-show-symlink-loop", lambda s: ["config", "show", "--config", str(s.loop())],
         2, "loop of symbolic links"),
    Case("config-show-bad-override", lambda s: ["config", "show", "steps=abc"], 2,
         "config key 'steps' expects int"),
    Case("config-show-unreadable", lambda s: [
        "config", "show", "--config", str(s.unreadable(s.file("c.yaml", "steps: 3\n")))], 1,
        "permission denied", unreadable=True),
    # ---- launch ----
    Case("launch-no-command", lambda s: ["launch", "-n", "2"], 2, "runs a training command"),
    Case("launch-not-train", lambda s: ["launch", "-n", "2", "--", "report", "x"], 2,
         "runs a training command"),
    Case("launch-no-processes", lambda s: ["launch", "-n", "0", "--", "train"], 2,
         "needs -n >= 1"),
    # ---- bench ceiling ----
    Case("bench-ceiling-too-small", lambda s: ["bench", "ceiling", "--size", "3"], 2,
         "--size >= 64"),
]


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` and what it holds (a file's bytes, a link's target)."""
    found = {}
    for path in [root, *root.rglob("*")]:
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[key] = "dir"
        else:
            try:
                found[key] = hashlib.sha1(path.read_bytes()).hexdigest()
            except OSError:
                found[key] = "unreadable"
    return found


def one_line(text: str, says: str, prefix: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), text
    assert re.search(says, lines[0]), lines[0]
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_command_answers_in_one_line(case, trained, tmp_path, monkeypatch, capsys,
                                          caplog):
    if case.unreadable and ROOT:
        pytest.skip("root reads through mode bits")
    monkeypatch.chdir(tmp_path)  # a default folder (runs/, compare.png) would land here
    sandbox = Sandbox(tmp_path, trained)
    try:
        argv = case.argv(sandbox)
        before = tree(tmp_path)
        caplog.set_level(logging.WARNING)
        code = main(argv)
        out, err = capsys.readouterr()
        after = tree(tmp_path)
    finally:
        if getattr(sandbox, "mounted", None):
            subprocess.run(["umount", "-l", str(sandbox.mounted)], check=False)
        for path in [tmp_path, *tmp_path.rglob("*")]:  # let pytest remove what was locked
            if not path.is_symlink():
                with contextlib.suppress(OSError):
                    path.chmod(0o755)
    assert code == case.code, (out, err)
    if case.stream == "out":
        assert err == "", err
        assert re.search(case.says, out), out
    else:
        one_line(err, case.says, "warning: " if code == 0 else "error: ")
    made = [Path(k) for k, v in after.items() if before.get(k) != v]
    outputs = [p for p in made if case.writes and p.match(case.writes)]
    touched = [p for p in made if not any(p.is_relative_to(o) for o in outputs)]
    assert touched == [], touched  # nothing but the command's own output was written
    assert all(k in after for k in before), sorted(set(before) - set(after))  # nor removed
    logged = [f"{r.name}: {r.getMessage()[:120]}" for r in caplog.records
              if r.name.startswith(LOGGERS)]
    assert logged == [], logged


# ---- the Python entry points -----------------------------------------------------------------


@pytest.mark.parametrize("what, expected", [
    ("missing", "does not exist: give an existing path"),
    ("long", "is too long for the file system"),
    ("file", "trainrun.load .* not a trainrun run directory, a Hugging Face model directory"),
    ("mlp", "trains model.kind=mlp; load reads transformer language models"),
    ("garbage", r"config\.yaml is damaged"),
])
def test_load_refuses_in_one_line(what, expected, trained, tmp_path):
    sandbox = Sandbox(tmp_path, trained)
    path = {"missing": sandbox.missing, "long": sandbox.long, "file": sandbox.file(),
            "mlp": sandbox.mlp, "garbage": sandbox.garbage("lm", "config.yaml")}[what]
    with pytest.raises(trainrun.UserError) as err:
        trainrun.load(path)
    assert "\n" not in str(err.value) and re.search(expected, str(err.value)), err.value


def test_load_reads_a_run_whose_step_record_is_garbled_without_a_log_line(trained, tmp_path,
                                                                          caplog):
    caplog.set_level(logging.WARNING)
    model = trainrun.load(Sandbox(tmp_path, trained).garbage(
        "lm", "checkpoints/1/_CHECKPOINT_METADATA"))
    assert model.step == 1
    assert [r for r in caplog.records if r.name.startswith(LOGGERS)] == []


def test_run_and_load_config_refuse_in_one_line(trained, tmp_path):
    sandbox = Sandbox(tmp_path, trained)
    with pytest.raises(trainrun.ConfigError, match="is not UTF-8 text"):
        trainrun.load_config(str(sandbox.garbage("mlp", "config.yaml") / "config.yaml"))
    with pytest.raises(trainrun.ConfigError, match="too long for the file system"):
        trainrun.load_config(str(sandbox.long))
    a_file = sandbox.file()
    with pytest.raises(trainrun.UserError, match="it is a file, not a directory"):
        trainrun.run(load_config("mlp", ["steps=2"]), a_file, out=io.StringIO())
    assert a_file.read_text() == "mine\n"


# ---- a hostile environment: each variable once, in a process of its own --------------------

COMMANDS = {  # name -> argv, on the trained runs
    "sample": lambda t, w: ["sample", str(t / "lm"), "--tokens", "2"],
    "export": lambda t, w: ["export", str(t / "lm"), "--to", str(w / "out")],
    "bench ceiling": lambda t, w: ["bench", "ceiling", "--size", "64", "--repeats", "1"],
    "verify-resume": lambda t, w: ["verify-resume", "--work-dir", str(w / "v"), "steps=4"],
    "train": lambda t, w: ["train", "--run-dir", str(w / "run"), "steps=2"],
    "report": lambda t, w: ["report", str(w / "mlp")],
    "compare": lambda t, w: ["compare", str(w / "mlp"), "--out", str(w / "c.png")],
}
ENVIRONMENTS = [  # variable, value, commands, expected exit code, what the line says
    ("JAX_PLATFORMS", "cuda", ["sample", "export", "bench ceiling", "verify-resume", "train"],
     2, "JAX cannot start a backend for JAX_PLATFORMS=cuda"),
    ("XLA_FLAGS", "--xla_force_host_platform_device_count=1 garbage",
     ["sample", "export", "bench ceiling", "verify-resume", "train"], 2,
     "XLA_FLAGS holds 'garbage', which is not an XLA flag"),
    ("HOME", "a-file", ["report", "compare", "bench ceiling"], None, "cache directory"),
]
RUN_EACH = """
import contextlib, io, json, sys
from trainrun.cli import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    results[name] = [code, err.getvalue()]
print(json.dumps(results))
"""


@pytest.mark.parametrize("variable, value, names, code, says", ENVIRONMENTS,
                         ids=[e[0] for e in ENVIRONMENTS])
def test_a_hostile_environment_is_one_line(variable, value, names, code, says, trained,
                                           tmp_path):
    shutil.copytree(trained / "mlp", tmp_path / "mlp")
    if value == "a-file":  # a home that is a file: nothing can be made under it
        value = str(tmp_path / "home")
        Path(value).write_text("mine\n")
    before = tree(tmp_path)
    env = cli_env(**{variable: value})
    env.pop("TRAINRUN_CACHE_DIR", None)
    argv = {name: COMMANDS[name](trained, tmp_path) for name in names}
    done = subprocess.run([sys.executable, "-c", RUN_EACH, json.dumps(argv)],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr  # nothing logged besides the lines below
    results = json.loads(done.stdout)
    for name, (got, err) in results.items():
        if code is None:  # HOME: the report tools need no home; the ceiling's cache does
            expected = 1 if name == "bench ceiling" else 0
            assert got == expected, (name, err)
            if expected:
                one_line(err, says, "error: ")
            else:
                assert err == "", (name, err)
            continue
        assert got == code, (name, err)
        one_line(err, says, "error: ")
    made = {k for k, v in tree(tmp_path).items() if before.get(k) != v}
    allowed = ("mlp/report", "c.png") if code is None else ()
    assert {k for k in made if not k.startswith(allowed)} == set(), sorted(made)
