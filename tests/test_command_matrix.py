"""Every command against bad paths, damaged run files and a hostile environment: one line that
names the problem and the fix, exit 2 for input and 1 for the environment, nothing of the user's
changed, no folder made that was not there, and no absl, Orbax, JAX or matplotlib log line.

One table, run in-process on copies of two tiny trained runs (an MLP, and a GPT-2-shaped LM
that `sample` and `export` take); a second table gives the commands locations on object storage
(``gs://``, ``s3://``, each emulator in turn) that hold no run or name no bucket, where nothing
in the bucket may change and no local folder (``gs:``) be made; the environment's cases run
each variable once in a subprocess, every command in it (JAX's backend and matplotlib read them
once per process)."""

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
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import cli_env, upload_run

import trainrun
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.storage import location, remote

ROOT = os.geteuid() == 0  # root reads and writes through any mode bits
LOGGERS = ("absl", "orbax", "jax", "matplotlib")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """``mlp``: 4 steps, checkpoints 2 and 4. ``lm``: a 1-layer byte LM in GPT-2's layout
    (learned positions, biases), 1 step: what `sample`, `export` and `load` read. Hugging Face
    directories for `train`'s init.from and `load`: ``hf-gpt2``, ``lm`` exported; ``hf-llama``,
    a 1-layer byte LM in the Llama layout; ``adapter``, LoRA adapters on ``hf-gpt2``."""
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
    hugging_face_dirs(root)
    return root


def hugging_face_dirs(root: Path) -> None:
    import jax
    import numpy as np

    from trainrun.checkpointing.reader import saved_config
    from trainrun.config import LoraConfig, TransformerModel
    from trainrun.export import export_run
    from trainrun.models import build_model
    from trainrun.models.huggingface import write_model_dir
    from trainrun.models.peft import write_adapter_dir

    export_run(root / "lm", root / "hf-gpt2")
    llama = TransformerModel(vocab=256, d_model=16, layers=1, heads=2, seq_len=16, mlp="swiglu",
                             mlp_hidden=32, norm="rmsnorm", tie_embeddings=False)
    params = jax.tree.map(np.asarray, build_model(llama).init(jax.random.key(0)))
    write_model_dir(params, llama, root / "hf-llama", model_type="llama")
    rng = np.random.default_rng(0)
    adapters = {"blocks": {"0": {"attn": {t: {
        "a": rng.normal(size=(16, 2)).astype(np.float32),
        "b": rng.normal(size=(2, 16)).astype(np.float32)} for t in ("q_lora", "v_lora")}}}}
    gpt2 = saved_config(root / "lm").model
    write_adapter_dir(adapters, gpt2.model_copy(update={"lora": LoraConfig(
        rank=2, alpha=4.0, targets=("q", "v"))}), "gpt2", str(root / "hf-gpt2"), root / "adapter")


class Sandbox:
    """A test's folder: copies of the trained runs made on first use, and the paths the table
    names. The command may change nothing in it (but for a case's declared outputs)."""

    def __init__(self, tmp: Path, trained: Path, bucket: str = ""):
        self.tmp, self.trained, self.bucket = tmp, trained, bucket
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

    def report_linked(self) -> Path:
        """A copy of the MLP run whose ``report.html`` is a link to a file of the user's."""
        (self.mlp / "report.html").symlink_to(self.file("elsewhere.html"))
        return self.mlp

    def started_from(self, source: Path) -> Path:
        """A copy of the LM run whose saved config says it started from ``source``."""
        import yaml

        config = self.lm / "config.yaml"
        saved = yaml.safe_load(config.read_text())
        saved["init"]["from"] = str(source)
        config.write_text(yaml.safe_dump(saved, sort_keys=False))
        return self.lm

    def linked_outside(self) -> Path:
        """A copy of ``hf-gpt2`` whose special_tokens_map.json links to a file outside it."""
        model = self.copy("hf-gpt2")
        (model / "special_tokens_map.json").symlink_to(self.file("secret", "api key\n"))
        return model

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

    def records_run(self, line: str, *settings: str) -> list[str]:
        """`train` on chat records: four good ones, then ``line`` (the fifth)."""
        path = self.tmp / "records.jsonl"
        good = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}]})
                for i in range(4)]
        path.write_text("\n".join([*good, line]) + "\n")
        return ["train", "--config", "chat", "--run-dir", str(self.tmp / "run"),
                "data.synthetic=null", f"data.paths={path}", "steps=2",
                "optimizer.schedule.kind=constant", *settings]

    def hf(self, name: str = "hf-gpt2", weights: str | None = None, **config) -> Path:
        """A copy of the Hugging Face directory ``name`` (an adapter directory too) with
        ``config`` in its config.json (adapter_config.json); ``weights``: a tensor of its
        model.safetensors stored as integers."""
        path = self.copy(name)
        file = path / ("adapter_config.json" if name == "adapter" else "config.json")
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
        if weights is not None:
            from safetensors.numpy import load_file, save_file

            tensors = load_file(str(path / "model.safetensors"))
            tensors[weights] = (tensors[weights] * 100).astype("int64")
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    # ---- on object storage: ``bucket`` is a new bucket on one of the emulators ----

    @property
    def nowhere(self) -> str:
        """A run in a bucket that does not exist, on the store of ``bucket``."""
        return f"{remote.scheme_of(self.bucket)}://trainrun-no-such-bucket/runs/x"

    def uploaded(self, name: str) -> str:
        """The trained run ``name`` in the bucket, as ``<bucket>/runs/<name>``."""
        return str(upload_run(self.trained / name, f"{self.bucket}/runs/{name}"))

    def prefix(self, name: str, **objects: str) -> str:
        """``<bucket>/<name>`` holding ``objects`` (name -> text)."""
        for key, text in objects.items():
            location.location(f"{self.bucket}/{name}/{key}").write_text(text)
        return f"{self.bucket}/{name}"

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


def finetune(s: Sandbox, source: Path | str) -> list[str]:
    """`train --config finetune` from ``source`` on a small corpus, into ``run``."""
    corpus = s.file("corpus.txt", "the quick brown fox jumps over the lazy dog.\n" * 60)
    return ["train", "--config", "finetune", "--run-dir", str(s.tmp / "run"),
            f"init.from={source}", "steps=2", "optimizer.schedule.warmup=0",
            "eval.every=0", f"data.paths=[{corpus}]", "data.seq_len=16", "data.batch_size=2",
            "metrics.tensorboard=false"]


# command -> its arguments with a location ``u`` where the command takes one
LOCATION_TAKERS: dict[str, Callable[[Sandbox, str], list[str]]] = {
    "train-run-dir": lambda s, u: ["train", "--run-dir", u, "steps=1"],
    "runs-root": lambda s, u: ["runs", "--root", u],
    "report": lambda s, u: ["report", u],
    "compare": lambda s, u: ["compare", str(s.mlp), u, "--out", str(s.tmp / "c.png")],
    "compare-out": lambda s, u: ["compare", str(s.mlp), "--out", u],
    "sample": lambda s, u: ["sample", u],
    "eval": lambda s, u: ["eval", u],
    "export": lambda s, u: ["export", u, "--to", str(s.tmp / "out")],
    "export-to": lambda s, u: ["export", str(s.lm), "--to", u],
    "verify-checkpoint": lambda s, u: ["verify-checkpoint", u],
    "verify-resume-work-dir": lambda s, u: ["verify-resume", "--work-dir", u, "steps=2"],
    "config-show-run-dir": lambda s, u: ["config", "show", "--run-dir", u],
    "train-checkpoint-dir": lambda s, u: [
        "train", "--run-dir", str(s.tmp / "run"), f"checkpoint.dir={u}"],
    "train-init-from": lambda s, u: finetune(s, u),
    "train-data-paths": lambda s, u: text_run(s, f"[{u}/*.txt]"),
    "train-records-paths": lambda s, u: [*s.records_run("{}")[:5], "data.synthetic=null",
                                         f"data.paths={u}/chat.jsonl"],
    "train-data-tokenizer": lambda s, u: s.records_run("{}", f"data.tokenizer={u}"),
    "train-arrays-paths": lambda s, u: [
        "train", "--run-dir", str(s.tmp / "run"), "data.kind=arrays", f"data.paths={u}/x.npz"],
    "train-tokens-paths": lambda s, u: [
        "train", "--run-dir", str(s.tmp / "run"), "data.kind=tokens", f"data.paths={u}/x.bin"],
}

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
    Case("report-html-a-link", lambda s: ["report", str(s.report_linked())], 0,
         r"wrote .*mlp/report\.html", stream="out", writes="mlp/report*"),  # not through it
    Case("report-read-only", lambda s: ["report", str(s.read_only(s.mlp))], 1, RO),
    Case("report-unreadable", lambda s: ["report", str(s.unreadable(s.mlp))], 1,
         "permission denied", unreadable=True),
    # ---- train on records (JSON Python's json would crash on, a template that never ends) ----
    Case("train-records-nested-too-deep", lambda s: s.records_run(
        '{"messages": ' + "[" * 200_000 + "]" * 200_000 + "}"), 2,
        r"record .*records\.jsonl:5: nested more than 500 levels deep.*data\.bad_records=skip"),
    Case("train-records-huge-integer", lambda s: s.records_run('{"n": ' + "7" * 5000 + "}"), 2,
         r"record .*records\.jsonl:5: an integer of more than 4300 digits"),
    Case("train-records-lone-surrogate", lambda s: s.records_run(
        '{"messages": [{"role": "user", "content": "\\ud800"}, '
        '{"role": "assistant", "content": "a"}]}'), 2,
        r"records\.jsonl:5: field messages\[0\]\.content holds a lone UTF-16 surrogate "
        r"\(\\ud800"),
    Case("train-records-endless-template", lambda s: s.records_run(
        "{}", "data.bad_records=skip",
        "data.chat_template='{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}'"), 2,
        r"the chat template \(data\.chat_template\) recurses without end.*fix the template"),
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
        "sample", str(s.garbage("lm", "checkpoints/1/_CHECKPOINT_METADATA")), "--tokens", "3",
        "--prompt", "a"], 0, "^a", stream="out"),  # the record is not needed: no absl line
    Case("sample-seed-past-64-bits", lambda s: [
        "sample", str(s.lm), "--seed", "18446744073709551617"], 2, "give a seed from 0 to"),
    Case("sample-temperature-nan", lambda s: ["sample", str(s.lm), "--temperature", "nan"], 2,
         "give a finite temperature >= 0"),
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
    Case("export-replace-the-runs-init-from", lambda s: [
        "export", str(s.started_from(s.copy("hf-gpt2"))), "--to", str(s.tmp / "hf-gpt2"),
        "--replace"], 2, r"--to .*hf-gpt2 is the init\.from of .*lm: the export reads it"),
    Case("export-a-source-file-linking-outside", lambda s: [
        "export", str(s.started_from(s.linked_outside())), "--to", str(s.tmp / "out")], 2,
        r"hf-gpt2/special_tokens_map\.json is a symbolic link to .*/secret, outside .*hf-gpt2"),
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
    Case("config-show-run-dir-garbage-config", lambda s: [
        "config", "show", "--run-dir", str(s.garbage("mlp", "config.yaml"))], 2,
        "is not UTF-8 text"),
    Case("config-show-unreadable", lambda s: [
        "config", "show", "--config", str(s.unreadable(s.file("c.yaml", "steps: 3\n")))], 1,
        "permission denied", unreadable=True),
    # ---- launch ----
    Case("launch-no-command", lambda s: ["launch", "-n", "2"], 2, "runs a training command"),
    Case("launch-not-train", lambda s: ["launch", "-n", "2", "--", "report", "x"], 2,
         "runs a training command"),
    Case("launch-no-processes", lambda s: ["launch", "-n", "0", "--", "train"], 2,
         "needs -n >= 1"),
    # ---- train --config finetune init.from=DIR (a Hugging Face or PEFT adapter directory) ----
    Case("train-init-from-config-json-zero-heads", lambda s: finetune(s, s.hf(n_head=0)), 2,
         r"config\.json has n_head 0, which is not a whole number from 1 .*save_pretrained"),
    Case("train-init-from-config-json-rope-list", lambda s: finetune(s, s.hf(
        "hf-llama", rope_parameters=[1, 2])), 2, r"config\.json has rope_parameters \[1, 2\], "
        "which is not an object of rotary settings"),
    Case("train-init-from-config-json-partial-rotary-text", lambda s: finetune(s, s.hf(
        "hf-llama", partial_rotary_factor="abc")), 2, "partial_rotary_factor 'abc', which is "
        "not a finite number above 0"),
    Case("train-init-from-config-json-sliding-window-text", lambda s: finetune(s, s.hf(
        "hf-llama", model_type="mistral", sliding_window="abc")), 2,
        "sliding_window 'abc', which is not a whole number"),
    Case("train-init-from-config-json-negative-width", lambda s: finetune(s, s.hf(
        "hf-llama", hidden_size=-32)), 2, "hidden_size -32, which is not a whole number"),
    Case("train-init-from-larger-than-memory", lambda s: finetune(s, s.hf(n_layer=10**12)), 2,
         r"the model of init\.from .*layers=1000000000000.* params, .* and .* of host memory "
         "is free"),
    Case("train-init-from-integer-weights", lambda s: finetune(s, s.hf(
        "hf-llama", weights="model.layers.0.mlp.up_proj.weight")), 2,
        r"tensor model\.layers\.0\.mlp\.up_proj\.weight in .*model\.safetensors has dtype "
        "I64; trainrun reads float weights"),
    Case("train-init-from-adapter-rank-text", lambda s: finetune(s, s.hf("adapter", r="eight")),
         2, r"adapter_config\.json has r 'eight', which is not a whole number"),
    Case("train-init-from-adapter-alpha-text", lambda s: finetune(s, s.hf(
        "adapter", lora_alpha="x")), 2, "lora_alpha 'x', which is not a finite number"),
    Case("train-init-from-adapter-number-in-targets", lambda s: finetune(s, s.hf(
        "adapter", target_modules=["c_attn", 3])), 2, r"target_modules\[1\] 3, which is not"),
    Case("train-init-from-adapter-rank-pattern-list", lambda s: finetune(s, s.hf(
        "adapter", rank_pattern=[1])), 2, r"rank_pattern \[1\], which is not an object"),
    Case("train-init-from-adapter-rank-pattern-bad-regex", lambda s: finetune(s, s.hf(
        "adapter", rank_pattern={"c_attn(": 4})), 2,
        r"rank_pattern key 'c_attn\(' is not a regular expression"),
    Case("train-init-from-unreadable-weights", lambda s: finetune(s, s.unreadable(
        s.hf() / "model.safetensors").parent), 1, r"permission denied: .*model\.safetensors",
        unreadable=True),
    # ---- bench ceiling ----
    Case("bench-ceiling-too-small", lambda s: ["bench", "ceiling", "--size", "3"], 2,
         "--size >= 64"),
    # ---- a location of another scheme, or a bucket URL that is no location: every command
    # that takes a location refuses it where it enters (no folder az: or gs: made here) ----
    *[Case(f"{name}-other-scheme", lambda s, argv=argv: argv(s, "az://c/x"), 2,
           r"'az://c/x[^']*': trainrun does not read or write az:// locations; give "
           r"gs://BUCKET/PATH, s3://BUCKET/PATH or a local path$")
      for name, argv in LOCATION_TAKERS.items()],
    *[Case(f"{name}-{kind}", lambda s, argv=LOCATION_TAKERS[name], url=url: argv(s, url), 2,
           says)
      for kind, url, says in (
          ("dot-dot-in-a-bucket-url", "s3://rel/runs/../../x",
           r"'s3://rel/runs/\.\./\.\./x[^']*' has a '\.\.' segment.* without '\.', '\.\.' or "
           "'//'$"),
          ("empty-segment-in-a-bucket-url", "gs://b//x", r"'gs://b//x[^']*' has an empty segment"),
          ("no-bucket", "s3://", r"^error: 's3://[^']*' names no bucket; give s3://BUCKET/PATH$"))
      for name in ("train-run-dir", "runs-root", "export-to", "train-data-paths")],
    Case("train-arrays-on-object-storage", lambda s: LOCATION_TAKERS["train-arrays-paths"](
        s, "gs://b"), 2, r"data\.paths: 'gs://b/x\.npz' is on object storage, and arrays and "
        "token files are memory-mapped from a local disk; copy it there"),
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
def test_each_command_answers_in_one_line(case, trained, tmp_path, tmp_path_factory,
                                          monkeypatch, capsys, caplog):
    answers_in_one_line(case, Sandbox(tmp_path, trained), tmp_path_factory, monkeypatch,
                        capsys, caplog)


def answers_in_one_line(case: Case, sandbox: Sandbox, tmp_path_factory: Any,
                        monkeypatch: pytest.MonkeyPatch, capsys: Any, caplog: Any) -> None:
    """Run ``case`` in ``sandbox`` and check its one line, that nothing but its declared
    output changed (in the sandbox, and in its bucket if it has one), and no log line."""
    if case.unreadable and ROOT:
        pytest.skip("root reads through mode bits")
    tmp_path = sandbox.tmp
    monkeypatch.chdir(tmp_path)  # a default folder (runs/, compare.png) would land here
    # what a command keeps there (tokenized records) is no change to the user's files
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        argv = case.argv(sandbox)
        before = tree(tmp_path)
        stored = bucket_objects(sandbox.bucket)
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
    assert bucket_objects(sandbox.bucket) == stored  # nothing in the bucket changed either


def bucket_objects(bucket: str) -> dict[str, str]:
    """Every object in ``bucket`` and the sha1 of its bytes ({} without a bucket)."""
    if not bucket:
        return {}
    root = location.location(bucket)
    return {name: hashlib.sha1((root / name).read_bytes()).hexdigest()
            for name in root.list_tree()}


NO_BUCKET = (r"bucket 'trainrun-no-such-bucket' does not exist \(reading (gs|s3)://.*/runs/x\): "
             r"check its name, or give another location")
NO_BUCKET_TO_WRITE = (r"bucket 'trainrun-no-such-bucket' does not exist \(writing (gs|s3)://"
                      r".*\): create it, or give another location")

REMOTE_CASES = [  # the same commands given locations on object storage
    Case("report-remote-missing", lambda s: ["report", f"{s.bucket}/runs/none"], 2,
         r"^error: (gs|s3)://bucket-.*/runs/none holds no trainrun run \(no config\.yaml\)"),
    Case("report-remote-no-bucket", lambda s: ["report", s.nowhere], 2, NO_BUCKET),
    *[Case(f"report-remote-someones-config-{kind}", lambda s, text=text: [
        "report", s.prefix("alice", **{"config.yaml": text})], 2,
        r"^error: (gs|s3)://bucket-.*/alice is not a trainrun run directory: its config\.yaml "
        r"is not one trainrun wrote \(no trainrun\.json beside it\)")
      for kind, text in (("mapping", "name: alice\nitems: [1, 2]\n"), ("list", "- 1\n- 2\n"))],
    Case("compare-remote-missing", lambda s: [
        "compare", str(s.mlp), f"{s.bucket}/runs/none", "--out", str(s.tmp / "c.png")], 2,
        "/runs/none holds no trainrun run"),
    Case("compare-remote-no-bucket", lambda s: [
        "compare", s.nowhere, "--out", str(s.tmp / "c.png")], 2, NO_BUCKET),
    Case("compare-out-remote-no-bucket", lambda s: [
        "compare", str(s.mlp), "--out", s.nowhere + "/c.png"], 2, NO_BUCKET_TO_WRITE),
    Case("runs-remote-empty-prefix", lambda s: ["runs", "--root", f"{s.bucket}/runs"], 0,
         r"^no runs under (gs|s3)://bucket-[^/]*/runs\n$", stream="out"),  # as a local folder
    Case("runs-remote-empty-bucket", lambda s: ["runs", "--root", s.bucket], 0,
         r"^no runs under (gs|s3)://bucket-[^/]*\n$", stream="out"),
    Case("runs-remote-an-object", lambda s: ["runs", "--root", s.prefix("x", y="mine") + "/y"],
         2, r"no runs directory (gs|s3)://bucket-.*/x/y; train a run first"),
    Case("runs-remote-no-bucket", lambda s: ["runs", "--root", s.nowhere], 2, NO_BUCKET),
    Case("verify-checkpoint-remote-missing", lambda s: [
        "verify-checkpoint", f"{s.bucket}/runs/none"], 2, "holds no trainrun run"),
    Case("verify-checkpoint-remote-no-bucket", lambda s: ["verify-checkpoint", s.nowhere], 2,
         NO_BUCKET),
    Case("verify-checkpoint-remote-no-such-step", lambda s: [
        "verify-checkpoint", s.uploaded("mlp"), "7"], 2,
        "has no checkpoint of step 7; its steps: 2, 4"),
    Case("sample-remote-missing", lambda s: ["sample", f"{s.bucket}/runs/none"], 2,
         "is not a run directory"),
    Case("sample-remote-no-bucket", lambda s: ["sample", s.nowhere], 2, NO_BUCKET),
    Case("sample-remote-an-mlp-run", lambda s: ["sample", s.uploaded("mlp")], 2,
         "sampling needs a language model"),
    Case("export-remote-missing", lambda s: [
        "export", f"{s.bucket}/runs/none", "--to", str(s.tmp / "out")], 2,
        "is not a run directory"),
    Case("export-remote-no-bucket", lambda s: ["export", s.nowhere, "--to", str(s.tmp / "out")],
         2, NO_BUCKET),
    Case("export-to-remote-no-bucket", lambda s: [
        "export", str(s.lm), "--to", s.nowhere + "/hf"], 2, NO_BUCKET_TO_WRITE),
    Case("export-to-remote-an-object", lambda s: [
        "export", str(s.lm), "--to", s.prefix("models", lm="mine\n") + "/lm"], 2,
        r"--to .*/models/lm is an object, not a folder"),
    Case("export-to-remote-inside-a-run", lambda s: [
        "export", str(s.lm), "--to", s.uploaded("mlp") + "/hf"], 2,
        r"--to .*/runs/mlp/hf is inside the trainrun folder .*/runs/mlp \(it has trainrun\.json"),
    Case("export-replace-remote-a-users-prefix", lambda s: [
        "export", str(s.lm), "--to", s.prefix("mine", **{"config.json": "{}", "src/a.py": "1"}),
        "--replace"], 2, r"--to .*/mine holds src/, which no export writes: it is not a model"),
    Case("export-to-remote-not-empty", lambda s: [
        "export", str(s.lm), "--to", s.prefix("models", **{"config.json": "{}",
                                                            "model.safetensors": "x"})], 2,
        r"--to .*/models is not empty \(it holds config\.json, model\.safetensors\); pass "
        "--replace"),
    Case("train-init-from-remote-missing", lambda s: finetune(s, f"{s.bucket}/runs/none"), 2,
         r"init\.from: no object or folder (gs|s3)://.*/runs/none; give the location of a run, "
         "a model directory or an adapter directory"),
    Case("train-init-from-remote-no-bucket", lambda s: finetune(s, s.nowhere), 2, NO_BUCKET),
]


@pytest.mark.parametrize("case", REMOTE_CASES, ids=lambda c: c.id)
def test_each_command_answers_a_bad_remote_location_in_one_line(case, bucket, trained, tmp_path,
                                                                tmp_path_factory, monkeypatch,
                                                                capsys, caplog):
    answers_in_one_line(case, Sandbox(tmp_path, trained, bucket), tmp_path_factory,
                        monkeypatch, capsys, caplog)


# ---- data and init.from on object storage (both emulators) ---------------------------------


def put(source: Path, url: str, cut: int = 0) -> str:
    """``source`` (a file, or a folder's files) uploaded to ``url``; ``cut``: bytes left off
    the end of each ``.safetensors`` file."""
    from trainrun.storage import location

    for file in [source] if source.is_file() else sorted(source.iterdir()):
        data = file.read_bytes()
        if cut and file.suffix == ".safetensors":
            data = data[:-cut]
        target = url if source.is_file() else f"{url}/{file.name}"
        location.location(target).write_bytes(data)
    return url


def text_run(s: Sandbox, paths: str, *settings: str) -> list[str]:
    """`train` of a byte LM on ``paths`` (a list), into ``run``."""
    return ["train", "--config", "lm", "--run-dir", str(s.tmp / "run"), "steps=2",
            "optimizer.schedule.kind=constant", f"data.paths={paths}", "data.seq_len=16",
            "data.batch_size=2", "metrics.tensorboard=false", *settings]


def glob_matching_nothing(s: Sandbox, bucket: str) -> list[str]:
    put(s.file(), f"{bucket}/corpus/a.txt")
    return text_run(s, f"[{bucket}/corpus/*.md]")


def cut_weights(s: Sandbox, bucket: str) -> list[str]:
    return finetune(s, put(s.trained / "hf-llama", f"{bucket}/models/llama", cut=100))


REMOTE_CASES = [  # id, argv(sandbox, bucket), what the one line says (exit 2)
    ("train-data-glob-matching-nothing", glob_matching_nothing,
     r"data\.paths pattern '.*/corpus/\*\.md' matches no objects; check the bucket"),
    ("train-data-missing-object", lambda s, b: text_run(s, f"[{b}/corpus/x.txt]"),
     r"data\.paths: no object .*/corpus/x\.txt; check the bucket and the path"),
    ("train-data-missing-bucket", lambda s, b: text_run(
        s, f"[{b.split(':')[0]}://no-such-bucket-here/*.txt]"),
     r"bucket 'no-such-bucket-here' does not exist \(reading .*\): "
     r"(create it|check its name), or give"),
    ("train-records-missing-object", lambda s, b: [
        *s.records_run("{}")[:5], "data.synthetic=null", f"data.paths={b}/chat.jsonl", "steps=2",
        "optimizer.schedule.kind=constant"],
     r"data\.paths: no object .*/chat\.jsonl"),
    ("train-records-tokenizer-missing", lambda s, b: s.records_run(
        "{}", f"data.tokenizer={b}/tokenizers/none"),
     r"data\.tokenizer: no object or folder .*/tokenizers/none; give a Hugging Face model"),
    ("train-init-from-missing", lambda s, b: finetune(s, f"{b}/models/none"),
     r"init\.from: no object or folder .*/models/none; give the location of a run, a model dir"),
    ("train-init-from-cut-weights", cut_weights,
     r"cannot read .*/models/llama/model\.safetensors: tensor '.*' \(F32 .*\) has "
     r"data_offsets .* outside the object's \d+ bytes .*is the file complete\?"),
]


@pytest.mark.parametrize("case", REMOTE_CASES, ids=lambda c: c[0])
def test_object_storage_inputs_answer_in_one_line(case, bucket, trained, tmp_path,
                                                  tmp_path_factory, monkeypatch, capsys,
                                                  caplog):
    """Bad data and init.from locations on gs:// and s3://: one line, exit 2, nothing made
    (no run directory, and no folder named gs: or s3: where the command runs)."""
    _, argv, says = case
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    sandbox = Sandbox(tmp_path, trained)
    args = argv(sandbox, bucket)
    before = tree(tmp_path)
    caplog.set_level(logging.WARNING)
    code = main(args)
    _, err = capsys.readouterr()
    assert code == 2, err
    one_line(err, says, "error: ")
    assert tree(tmp_path) == before  # no run directory, no gs: or s3: folder
    assert [r for r in caplog.records if r.name.startswith(LOGGERS)] == []


# ---- the Python entry points -----------------------------------------------------------------


@pytest.mark.parametrize("what, expected", [
    ("missing", "does not exist: give an existing path"),
    ("long", "is too long for the file system"),
    ("file", "trainrun.load .* not a trainrun run directory, a Hugging Face model directory"),
    ("mlp", "trains model.kind=mlp; load reads transformer language models"),
    ("garbage", r"config\.yaml is damaged"),
    ("other-scheme", "^'az://c/x': trainrun does not read or write az:// locations; give gs://"),
])
def test_load_refuses_in_one_line(what, expected, trained, tmp_path):
    sandbox = Sandbox(tmp_path, trained)
    path = {"missing": sandbox.missing, "long": sandbox.long, "file": sandbox.file(),
            "mlp": sandbox.mlp, "garbage": sandbox.garbage("lm", "config.yaml"),
            "other-scheme": "az://c/x"}[what]
    with pytest.raises(trainrun.UserError) as err:
        trainrun.load(path)
    assert "\n" not in str(err.value) and re.search(expected, str(err.value)), err.value


@pytest.mark.parametrize("where, expected", [
    ("none", r"(gs|s3)://bucket-.*/runs/none holds no trainrun run \(no config\.yaml\); on "
             "object storage trainrun.load reads run directories"),
    ("nowhere", NO_BUCKET),
    ("mlp", r"(gs|s3)://bucket-.*/runs/mlp trains model.kind=mlp; load reads transformer"),
])
def test_load_refuses_a_bad_remote_location_in_one_line(where, expected, bucket, trained,
                                                        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sandbox = Sandbox(tmp_path, trained, bucket)
    path = {"none": f"{bucket}/runs/none", "nowhere": sandbox.nowhere,
            "mlp": sandbox.uploaded("mlp") if where == "mlp" else ""}[where]
    with pytest.raises(trainrun.UserError) as err:
        trainrun.load(path)
    assert "\n" not in str(err.value) and re.search(expected, str(err.value)), err.value
    assert list(tmp_path.iterdir()) == []  # no local folder named gs: or s3:


@pytest.mark.parametrize("name, changes, expected", [
    ("hf-gpt2", {"n_head": 0}, r"config\.json has n_head 0, which is not a whole number"),
    ("hf-llama", {"rope_parameters": [1, 2]}, r"rope_parameters \[1, 2\], which is not"),
    ("hf-llama", {"num_attention_heads": 0}, "num_attention_heads 0, which is not"),
    ("hf-gpt2", {"n_layer": 10**12}, r"layers=1000000000000.* params, .* is free"),
    ("hf-llama", {"weights": "model.norm.weight"}, "model.norm.weight in .* has dtype I64"),
    ("adapter", {"r": "eight"}, r"adapter_config\.json has r 'eight', which is not"),
    ("adapter", {"rank_pattern": {"(": 4}}, "rank_pattern key '\\(' is not a regular"),
])
def test_load_refuses_a_bad_hugging_face_directory_in_one_line(name, changes, expected,
                                                               trained, tmp_path):
    path = Sandbox(tmp_path, trained).hf(name, **changes)
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
    "train records": lambda t, w: [
        "train", "--config", "chat", "--run-dir", str(w / "run"), "data.synthetic=null",
        f"data.paths={w / 'chat.jsonl'}", "steps=2", "optimizer.schedule.kind=constant"],
}
ENVIRONMENTS = [  # variable, value, commands, expected exit code, what the line says
    ("JAX_PLATFORMS", "cuda", ["sample", "export", "bench ceiling", "verify-resume", "train"],
     2, "JAX cannot start a backend for JAX_PLATFORMS=cuda"),
    ("XLA_FLAGS", "--xla_force_host_platform_device_count=1 garbage",
     ["sample", "export", "bench ceiling", "verify-resume", "train"], 2,
     "XLA_FLAGS holds 'garbage', which is not an XLA flag"),
    ("HOME", "a-file", ["report", "compare", "bench ceiling"], None, "cache directory"),
    ("TRAINRUN_CACHE_DIR", "read-only", ["train records"], 1,
     r"^error: cannot keep the tokenized records in /.*/records: (read-only file system|"
     r"permission denied); make it writable, or set TRAINRUN_CACHE_DIR"),
    ("TRAINRUN_CACHE_DIR", "full", ["train records"], 1,
     r"^error: cannot keep the tokenized records in /.*/records: no space left on device; free "
     r"space there, or set TRAINRUN_CACHE_DIR to a directory with room$"),
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


def refusing_cache(kind: str, request: pytest.FixtureRequest) -> Path:
    """A cache directory outside the test's folder that the file system refuses: ``read-only``
    (a read-only tmpfs as root, mode bits otherwise) or ``full`` (a 64 KiB tmpfs, root only)."""
    folder = Path(tempfile.mkdtemp(prefix="trainrun-cache-"))
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    if not ROOT:
        if kind == "full":
            pytest.skip("a full file system is a tmpfs mount here, which needs root")
        folder.chmod(0o555)
        request.addfinalizer(lambda: folder.chmod(0o755))  # before the removal above
        return folder
    options = "size=64k,ro" if kind == "read-only" else "size=64k"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"a {kind} cache directory needs a tmpfs mount: {done.stderr.strip()}")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(folder)], check=False))
    return folder


@pytest.mark.parametrize("variable, value, names, code, says", [
    pytest.param(*e, id=e[0]) if e[0] != "TRAINRUN_CACHE_DIR" else  # a run, then its refusal
    pytest.param(*e, id=f"{e[0]}-{e[1]}", marks=pytest.mark.slow) for e in ENVIRONMENTS])
def test_a_hostile_environment_is_one_line(variable, value, names, code, says, trained,
                                           tmp_path, request):
    shutil.copytree(trained / "mlp", tmp_path / "mlp")
    if value == "a-file":  # a home that is a file: nothing can be made under it
        value = str(tmp_path / "home")
        Path(value).write_text("mine\n")
    if value in ("read-only", "full"):  # a cache directory with no room for the records' rows
        value = str(refusing_cache(value, request))
    if "train records" in names:  # more rows than 64 KiB
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i} " * 4}]}) + "\n" for i in range(400)))
    before = tree(tmp_path)
    env = cli_env(**{variable: value})
    if variable != "TRAINRUN_CACHE_DIR":
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
