"""``trainrun export --to``: a new or empty directory is written, anything else is refused on one
line with nothing changed; ``--replace`` leaves exactly the new export, and a failure midway
leaves the old directory as it was."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainrun import export, rundir
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.errors import WriteFailed
from trainrun.training.loop import run

pytest.importorskip("safetensors", reason="the tests' extra holds safetensors")

FILES = ["config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A 2-step byte-level LM in GPT-2's layout."""
    tmp_path = tmp_path_factory.mktemp("export")
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1", "metrics.tensorboard=false", "model.d_model=32",
        "model.layers=2", "model.heads=2", "model.seq_len=32", "model.positions=learned",
        "model.bias=true", f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=4"])
    run(config, tmp_path / "run", out=io.StringIO())
    return tmp_path / "run"


def listing(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
            for p in sorted(path.rglob("*"))}


def export_cli(capfd, *args: str) -> tuple[int, str]:
    code = main(["export", *args])
    captured = capfd.readouterr()
    return code, captured.err


def stale_model_dir(path: Path) -> Path:
    """A model directory from an earlier export, with a file this export does not write."""
    path.mkdir()
    (path / "config.json").write_text('{"old": true}\n')
    (path / "model.safetensors").write_bytes(b"old weights")
    (path / "generation_config.json").write_text('{"old": true}\n')
    return path


# A --to that is refused is refused before the run is read: these need no trained run.
NO_RUN = "runs/never-read"


def test_export_to_an_existing_file_is_refused_and_leaves_it(tmp_path, capfd):
    target = tmp_path / "model"
    target.write_text("mine\n")
    code, err = export_cli(capfd, NO_RUN, "--to", str(target))
    assert code == 2 and err.count("\n") == 1 and "is a file, not a directory" in err, err
    assert target.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_to_a_non_empty_directory_is_refused_and_names_replace(tmp_path, capfd):
    target = stale_model_dir(tmp_path / "model")
    before = listing(target)
    code, err = export_cli(capfd, NO_RUN, "--to", str(target))
    assert code == 2 and err.count("\n") == 1, err
    assert f"--to {target} is not empty" in err and "--replace" in err
    assert listing(target) == before

    user = tmp_path / "notes"  # --replace deletes only a model directory
    user.mkdir()
    (user / "todo.txt").write_text("mine\n")
    code, err = export_cli(capfd, NO_RUN, "--to", str(user), "--replace")
    assert code == 2 and err.count("\n") == 1 and "not a model directory" in err, err
    assert listing(user) == {"todo.txt": b"mine\n"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes"]


@pytest.mark.slow
def test_export_to_a_new_or_empty_directory_writes_it(lm_run, tmp_path, capfd):
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (empty, tmp_path / "new" / "model"):
        code, _ = export_cli(capfd, str(lm_run), "--to", str(target))
        assert code == 0 and sorted(p.name for p in target.iterdir()) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]  # no staging left


@pytest.mark.slow
def test_replace_leaves_exactly_the_new_export(lm_run, tmp_path, capfd):
    fresh = tmp_path / "fresh"
    assert export_cli(capfd, str(lm_run), "--to", str(fresh))[0] == 0
    target = stale_model_dir(tmp_path / "model")
    code, err = export_cli(capfd, str(lm_run), "--to", str(target), "--replace")
    assert code == 0, err
    assert listing(target) == listing(fresh)  # nothing stale: no generation_config.json
    assert json.loads((target / "config.json").read_text())["n_embd"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "model"]


FULL = "error: no space left on device: {}; free some space or give another place (the " \
       "export was not written; {} is as it was)\n"


@pytest.mark.slow
def test_a_failure_midway_leaves_the_old_directory(lm_run, tmp_path, monkeypatch, capfd):
    """A full disk is one line naming --to, exit 1, the old export whole, no staging left:
    as an OSError, and as the SafetensorError safetensors raises for one (which was a
    traceback)."""
    from safetensors import SafetensorError

    from trainrun.models import huggingface

    target = stale_model_dir(tmp_path / "model")
    before = listing(target)

    def full_disk(params, cfg, path: Path, **_) -> Path:
        (path / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device", str(path / "model.safetensors"))

    def full_disk_in_safetensors(tensors, file: Path, dtype: str) -> Path:
        file.write_bytes(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(export, "write_model_dir", full_disk)
    with pytest.raises(WriteFailed, match="no space left on device"):
        export.export_run(lm_run, target, replace=True)
    assert export_cli(capfd, str(lm_run), "--to", str(target), "--replace") == (
        1, FULL.format(target, target))
    monkeypatch.undo()
    monkeypatch.setattr(huggingface, "_write_shard", full_disk_in_safetensors)
    assert export_cli(capfd, str(lm_run), "--to", str(target), "--replace") == (
        1, FULL.format(target, target))
    assert listing(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left


@pytest.mark.slow
def test_replace_onto_a_full_disk_is_one_line_and_keeps_the_old_export(lm_run, tmp_path,
                                                                        capfd):
    """A real full disk (a tmpfs with room for one export, root only)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mount -t tmpfs is not allowed here: {done.stderr.strip()}")
    try:
        target = mnt / "model"
        assert export_cli(capfd, str(lm_run), "--to", str(target))[0] == 0
        before = listing(target)
        assert export_cli(capfd, str(lm_run), "--to", str(target), "--replace") == (
            1, FULL.format(target, target))
        assert listing(target) == before
        assert sorted(p.name for p in mnt.iterdir()) == ["model"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_a_tokenized_run_exports_its_tokenizer_and_token_ids(tmp_path, capfd):
    """Before, the export of a run trained with a tokenizer had neither the tokenizer nor its
    bos/eos ids (null), so transformers could not stop or start a document."""
    tokenizers = pytest.importorskip("tokenizers")
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm_bpe", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1", "metrics.tensorboard=false", "model.d_model=32",
        "model.layers=1", "model.heads=2", "model.seq_len=32", "model.positions=learned",
        "model.bias=true", "model.vocab=300", f"data.paths=[{corpus}]", "data.seq_len=32",
        "data.batch_size=4", f"data.tokenizer={tmp_path / 'tok.json'}", "data.vocab_size=300"])
    run(config, tmp_path / "run", out=io.StringIO())
    code, err = export_cli(capfd, str(tmp_path / "run"), "--to", str(tmp_path / "out"))
    assert code == 0, err
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    document = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(
        "<|endoftext|>")
    hf = json.loads((out / "config.json").read_text())
    assert hf["bos_token_id"] == hf["eos_token_id"] == document is not None


# ---- what --replace may replace, and what an export reads ------------------------------------


def project_folder(path: Path) -> Path:
    """A user's project: a config.json of their own beside their sources and a thesis."""
    (path / "src").mkdir(parents=True)
    (path / "src" / "main.py").write_text("print('mine')\n")
    (path / "thesis.txt").write_text("three years of work\n")
    (path / "config.json").write_text('{"mine": true}\n')
    return path


def hub_like_folder(path: Path) -> Path:
    """A folder whose model files are links to files kept elsewhere (a hub snapshot's way)."""
    blobs = path.parent / "blobs"
    blobs.mkdir()
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        (blobs / name).write_text(f"the real {name}\n")
        (path / name).symlink_to(blobs / name)
    return path


def notes_folder(path: Path) -> Path:
    """Names an export writes, but no weights: not a model directory."""
    path.mkdir()
    (path / "config.json").write_text('{"mine": true}\n')
    (path / "README.md").write_text("my notes\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("make, says", [
    (project_folder, r"holds src/, thesis\.txt, which no export writes: it is not a model "),
    (hub_like_folder, r"holds config\.json \(a symbolic link\), model\.safetensors \(a symbolic "
                      r"link\), which no export writes"),
    (notes_folder, r"holds README\.md, config\.json and no weights: it is not a model dir"),
], ids=["a-project", "links-to-files-elsewhere", "no-weights"])
def test_replace_leaves_a_folder_that_is_not_a_model_directory(lm_run, tmp_path, capfd, make,
                                                               says):
    """Before, any folder with a config.json or weights among its files was deleted whole."""
    target = make(tmp_path / "myproject")
    before = listing(tmp_path)
    code, err = export_cli(capfd, str(lm_run), "--to", str(target), "--replace")
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(says, err), err
    code, err = export_cli(capfd, str(lm_run), "--to", str(target))
    assert code == 2 and err.count("\n") == 1 and "is not empty" in err, err
    assert "--replace" not in err  # which would refuse it too
    assert listing(tmp_path) == before


@pytest.mark.slow
def test_replace_never_deletes_the_run_or_writes_into_one(lm_run, tmp_path, capfd):
    """Before, `export proj/runs/x --to proj --replace` deleted the run it exported, and
    `--to RUN/hf` wrote into the run directory."""
    project = tmp_path / "proj"
    shutil.copytree(lm_run, project / "runs" / "sft")
    (project / "config.json").write_text('{"mine": true}\n')
    before = listing(tmp_path)
    code, err = export_cli(capfd, str(project / "runs" / "sft"), "--to", str(project),
                           "--replace")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--to {project} holds the run being exported ({project}/runs/sft)" in err
    inside = project / "runs" / "sft" / "hf"
    code, err = export_cli(capfd, str(project / "runs" / "sft"), "--to", str(inside))
    assert code == 2 and err.count("\n") == 1, err
    assert f"is inside the trainrun folder {project}/runs/sft (it has trainrun.json)" in err
    assert listing(tmp_path) == before


@pytest.fixture(scope="module")
def lora_run(lm_run, tmp_path_factory) -> Path:
    """A 2-step LoRA run whose init.from is ``base``: a GPT-2 directory (an export of
    ``lm_run``) with a tokenizer config; ``adapters``: its adapters exported."""
    root = tmp_path_factory.mktemp("lora")
    export.export_run(lm_run, root / "base")
    (root / "base" / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    corpus = root / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1", "metrics.tensorboard=false", "model.d_model=32",
        "model.layers=2", "model.heads=2", "model.seq_len=32", "model.positions=learned",
        "model.bias=true", f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=4",
        f"init.from={root / 'base'}",
        "model.lora={rank: 4, alpha: 8, targets: [q, v]}"])
    run(config, root / "run", out=io.StringIO())
    export.export_run(root / "run", root / "adapters")
    return root / "run"


def started_from(run_dir: Path, source: Path, copy: Path) -> Path:
    """A copy of ``run_dir`` whose config says it started from ``source``."""
    shutil.copytree(run_dir, copy)
    saved = rundir.read_yaml(copy / rundir.CONFIG)
    saved["init"]["from"] = str(source)
    (copy / rundir.CONFIG).write_text(yaml.safe_dump(saved, sort_keys=False))
    return copy


@pytest.mark.slow
def test_replace_never_deletes_what_the_export_reads(lora_run, tmp_path, capfd):
    """Before, `--to` the run's own init.from (or its adapters' base model) replaced the base
    weights with adapters that named the deleted folder as their base."""
    base = shutil.copytree(lora_run.parent / "base", tmp_path / "base")
    run_dir = started_from(lora_run, base, tmp_path / "run")
    before = listing(tmp_path)
    code, err = export_cli(capfd, str(run_dir), "--to", str(base), "--replace")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--to {base} is the init.from of {run_dir}: the export reads it" in err
    assert listing(tmp_path) == before

    adapters = shutil.copytree(lora_run.parent / "adapters", tmp_path / "adapters")
    config = json.loads((adapters / "adapter_config.json").read_text())
    (adapters / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": str(base)}))
    forked = started_from(lora_run, adapters, tmp_path / "forked")
    before = listing(tmp_path)
    code, err = export_cli(capfd, str(forked), "--to", str(base), "--replace")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--to {base} is the base model of the adapters in {adapters}" in err
    code, err = export_cli(capfd, str(forked), "--to", str(adapters), "--replace")
    assert code == 2 and f"--to {adapters} is the init.from of {forked}" in err, err
    assert listing(tmp_path) == before


@pytest.mark.slow
def test_a_source_file_linking_outside_the_source_is_refused(lora_run, tmp_path, capfd):
    """Before, a special_tokens_map.json linking to a secret put the secret in the export."""
    (tmp_path / "secret").write_text("api key\n")
    base = shutil.copytree(lora_run.parent / "base", tmp_path / "base")
    (base / "special_tokens_map.json").symlink_to(tmp_path / "secret")
    run_dir = started_from(lora_run, base, tmp_path / "run")
    out = tmp_path / "out"
    code, err = export_cli(capfd, str(run_dir), "--to", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert (f"{base}/special_tokens_map.json is a symbolic link to {tmp_path}/secret, outside "
            f"{base}") in err
    assert not out.exists()


@pytest.mark.slow
def test_links_inside_the_source_or_a_hub_snapshot_are_copied_as_files(lora_run, tmp_path,
                                                                       capfd):
    """A link within the source folder, and a hub snapshot's links into its blobs/, are read:
    the export holds the files themselves."""
    base = lora_run.parent / "base"
    repo = tmp_path / "hub" / "models--me--base"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        shutil.copyfile(base / name, repo / "blobs" / f"blob-{name}")
        (snapshot / name).symlink_to(Path("..", "..", "blobs", f"blob-{name}"))
    (snapshot / "special_tokens_map.json").symlink_to("tokenizer_config.json")  # in the source
    run_dir = started_from(lora_run, snapshot, tmp_path / "run")
    out = tmp_path / "out"
    code, err = export_cli(capfd, str(run_dir), "--to", str(out))
    assert code == 0, err
    files = {p.name: p for p in out.iterdir()}
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors",
                             "special_tokens_map.json", "tokenizer_config.json"]
    assert not any(p.is_symlink() for p in files.values())
    tokenizer = (base / "tokenizer_config.json").read_bytes()
    assert files["tokenizer_config.json"].read_bytes() == tokenizer
    assert files["special_tokens_map.json"].read_bytes() == tokenizer


# ---- the source's config.json -----------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_source(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama directory whose config.json holds values trainrun would not write (an
    initializer_range of 0.1, keys it does not know, the hub's nested rope_scaling beside
    rope_parameters, torch_dtype, an eos id unlike the generation config's), and a byte corpus
    to fine-tune it on."""
    from conftest import save_tiny_causal_lm

    root = tmp_path_factory.mktemp("odd")
    source = save_tiny_causal_lm(root / "llama", "llama", vocab_size=300)
    hf = json.loads((source / "config.json").read_text())
    del hf["dtype"]
    hf.update(initializer_range=0.1, torch_dtype="float32", eos_token_id=2,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
              lab_notes={"kept": ["as", "written"], "depth": {"x": 1.5}}, use_cache=False)
    (source / "config.json").write_text(json.dumps(hf, indent=1))
    generation = json.loads((source / "generation_config.json").read_text())
    (source / "generation_config.json").write_text(json.dumps({**generation,
                                                               "eos_token_id": [2, 7]}))
    corpus = root / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    return source, corpus


def fine_tuned(source: Path, corpus: Path, run_dir: Path, *extra: str) -> Path:
    config = load_config("finetune", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1", "metrics.tensorboard=false", f"init.from={source}",
        f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=2", *extra])
    run(config, run_dir, out=io.StringIO())
    return run_dir


@pytest.mark.slow
def test_the_source_config_json_is_kept_as_it_was(odd_source, tmp_path):
    """Before, the export wrote initializer_range 0.02 over 0.1, added a top-level rope_theta,
    renamed torch_dtype and took the generation config's eos ids into config.json."""
    source, corpus = odd_source
    before = json.loads((source / "config.json").read_text())
    full = export.export_run(fine_tuned(source, corpus, tmp_path / "full"), tmp_path / "out")
    assert json.loads((full.path / "config.json").read_text()) == before

    lora = fine_tuned(source, corpus, tmp_path / "lora", "model.lora={rank: 4, targets: [q, v]}")
    adapters = export.export_run(lora, tmp_path / "adapters")
    assert "config.json" not in adapters.files  # the adapters name the source as their base
    assert json.loads((adapters.path / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(source)
    merged = export.export_run(lora, tmp_path / "merged", merge=True)
    assert json.loads((merged.path / "config.json").read_text()) == before
    assert json.loads((source / "config.json").read_text()) == before


def test_a_run_from_scratch_exports_the_config_json_it_did(lm_run, tmp_path):
    """No source config.json: every field is trainrun's, as before."""
    out = export.export_run(lm_run, tmp_path / "out")
    assert json.loads((out.path / "config.json").read_text()) == SCRATCH_CONFIG


@pytest.mark.slow
def test_a_rotary_run_from_scratch_exports_the_context_it_generates_within(tmp_path):
    """Before, its config.json said max_position_embeddings = the rows' length (24) while
    ``load(RUN)`` generated within 2048 positions: the export now says what the run reads."""
    import trainrun
    from trainrun.checkpointing.run_context import ROPE_CONTEXT

    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=2", "steps_per_call=1", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=1",
        "metrics.tensorboard=false", "model.d_model=32", "model.layers=1", "model.heads=2",
        "model.seq_len=24", "model.norm=rmsnorm", "model.mlp=swiglu", f"data.paths=[{corpus}]",
        "data.seq_len=24", "data.batch_size=2"])
    assert config.model.positions != "learned"  # type: ignore[union-attr]
    run(config, tmp_path / "run", out=io.StringIO())
    out = export.export_run(tmp_path / "run", tmp_path / "out")
    written = json.loads((out.path / "config.json").read_text())
    assert written["max_position_embeddings"] == ROPE_CONTEXT
    assert (trainrun.load(tmp_path / "run").config.seq_len
            == trainrun.load(out.path).config.seq_len == ROPE_CONTEXT)


SCRATCH_CONFIG = {  # what the export wrote before config.json kept a source's fields
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
    "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_inner": 128,
    "n_positions": 32, "layer_norm_epsilon": 1e-05, "initializer_range": 0.02,
    "tie_word_embeddings": True, "scale_attn_weights": True, "bos_token_id": None,
    "eos_token_id": None, "dtype": "float32"}


# ---- what a killed export leaves -------------------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.slow
def test_the_next_export_removes_what_a_killed_export_left(lm_run, tmp_path, capfd):
    """Before, a `kill -9` mid-export left `.<to>.export-<pid>-<hex>` folders for good."""
    target = stale_model_dir(tmp_path / "model")
    dead, alive = dead_pid(), os.getppid()
    left = [tmp_path / f".model.export-{dead}-deadbeef", tmp_path / f".model.export-{dead}-"
            "0badcafe.old"]
    kept = [tmp_path / f".model.export-{alive}-12345678",  # an export still running
            tmp_path / f".other.export-{dead}-deadbeef"]  # another target's
    for folder in left + kept:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    code, err = export_cli(capfd, str(lm_run), "--to", str(target), "--replace")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["model", *(p.name for p in kept)])
    assert sorted(p.name for p in target.iterdir()) == FILES


def test_an_old_export_a_kill_left_aside_is_put_back(tmp_path, capfd):
    """Killed between moving the old export aside and renaming the new one in: the next
    export to that place finds the old one back in place (here: refused, being not empty)."""
    target = tmp_path / "model"
    aside = stale_model_dir(tmp_path / f".model.export-{dead_pid()}-0badcafe.old")
    before = listing(aside)
    code, err = export_cli(capfd, NO_RUN, "--to", str(target))
    assert code == 2 and f"--to {target} is not empty" in err, err
    assert listing(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ---- --step ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_step_exports_that_checkpoint_and_a_step_there_is_not_is_one_line(tmp_path, capfd):
    import jax
    import numpy as np

    import trainrun
    from trainrun.checkpointing.reader import latest_params

    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", [
        "steps=2", "steps_per_call=1", "checkpoint.every=1", "eval.every=0",
        "optimizer.schedule.warmup=1", "metrics.tensorboard=false", "model.d_model=32",
        "model.layers=1", "model.heads=2", "model.seq_len=24", "model.norm=rmsnorm",
        "model.mlp=swiglu", f"data.paths=[{corpus}]", "data.seq_len=24", "data.batch_size=2"])
    run(config, tmp_path / "run", out=io.StringIO())
    code, err = export_cli(capfd, str(tmp_path / "run"), "--to", str(tmp_path / "none"),
                           "--step", "5")
    assert (code, err) == (2, f"error: {tmp_path / 'run'} has no checkpoint of step 5; its "
                              "steps: 1, 2\n")
    assert not (tmp_path / "none").exists()
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "one"),
                 "--step", "1"]) == 0
    assert capfd.readouterr().out.startswith(f"step 1 of {tmp_path / 'run'} written to ")
    exported = trainrun.load(tmp_path / "one").params
    for step, same in ((1, True), (2, False)):
        _, params = latest_params(tmp_path / "run", config, step)
        agree = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), exported, params)
        assert all(jax.tree.leaves(agree)) is same, step
