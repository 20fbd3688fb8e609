"""``trainrun verify-resume`` proves bitwise resume on every kind of run: from a Hugging Face
model (``init.from``), with LoRA adapters on chat records, and from a PEFT adapter directory
(the built-in MLP, the resnet and records on their own are checked in their own tests); and
such runs extend by their run directory alone, as the README's resume form says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_tiny_causal_lm

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

# A short fine-tune: one kill after the committed checkpoint at 4 and one during the save of 8.
SHORT = ["--config", "finetune", "steps=12", "steps_per_call=2", "checkpoint.every=4",
         "eval.every=0", "data.seq_len=32", "data.batch_size=4",
         "optimizer.schedule.warmup=2", "metrics.tensorboard=false"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A random Llama with 300 tokens: the byte tokenizer's 259 fit."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("llama") / "llama", "llama",
                               vocab_size=300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.py"
    path.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 60)
    return path


def verified(cli, tmp_path: Path, *args: str) -> str:
    """verify-resume's output, which must say PASS."""
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), *SHORT, *args,
                 TRAINRUN_CACHE_DIR=str(tmp_path / "cache"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS" in result.stdout
    return result.stdout


@pytest.mark.slow
def test_a_full_fine_tune_from_a_model_directory_resumes_bitwise(cli, tmp_path, llama, corpus):
    """Before, the config verify-resume wrote for its runs set the default d_model, which the
    model's config.json contradicts: every run was refused and the summary said only 'exit 2'."""
    verified(cli, tmp_path, f"init.from={llama}", f"data.paths=[{corpus}]")


@pytest.mark.slow
def test_lora_on_chat_records_resumes_bitwise(cli, tmp_path, llama):
    records = tmp_path / "chat.jsonl"
    records.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Count."},
        {"role": "user", "content": f"after {i}"},
        {"role": "assistant", "content": f"{i + 1}"}]}) + "\n" for i in range(200)))
    verified(cli, tmp_path, f"init.from={llama}", "model.lora={targets: all-linear, rank: 4}",
             "data.kind=records", f"data.paths=[{records}]", "data.tokenizer=bytes",
             "data.chat_template=chatml", "data.eval_fraction=0", "data.seq_len=96",
             "--kill-in-save", "8")  # the harder kill alone: the first test has both


@pytest.mark.slow
def test_a_run_from_a_peft_adapter_directory_resumes_bitwise(cli, tmp_path, llama, corpus):
    peft = pytest.importorskip("peft")
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(llama)
    adapters = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8,
                                                         target_modules=["q_proj", "v_proj"]))
    adapters.save_pretrained(tmp_path / "adapter")
    verified(cli, tmp_path, f"init.from={tmp_path / 'adapter'}", f"data.paths=[{corpus}]",
             "--kill-in-save", "8")


def test_a_refused_run_is_named_by_its_own_error_line(cli, tmp_path, llama):
    """A run that exits 2 is reported with the line it printed, not only a log's path."""
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), *SHORT,
                 f"init.from={llama}", "data.paths=[/nonexistent/*.py]")
    assert result.returncode != 0
    assert "/nonexistent/*.py" in result.stdout + result.stderr


def chat_records(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Count."},
        {"role": "user", "content": f"after {i}"},
        {"role": "assistant", "content": f"{i + 1}"}]}) + "\n" for i in range(200)))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full-fine-tune", "lora-on-chat-records"])
def test_a_fine_tuning_run_extends_by_its_run_directory_alone(tmp_path, llama, corpus, kind,
                                                              monkeypatch, capfd):
    """`trainrun train --run-dir DIR steps=N` takes DIR's saved config as the base, init.from
    and records included; before, the default mlp config was, and the run was refused as
    changed. `config show --run-dir DIR` shows that config."""
    from trainrun.cli import main

    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    data = [f"data.paths=[{corpus}]"] if kind == "full-fine-tune" else [
        "model.lora={targets: all-linear, rank: 4}", "data.kind=records",
        f"data.paths=[{chat_records(tmp_path / 'chat.jsonl')}]", "data.tokenizer=bytes",
        "data.chat_template=chatml", "data.eval_fraction=0", "data.seq_len=96"]
    first = [a for a in SHORT if not a.startswith(("steps=", "checkpoint.every=", "optim"))]
    run_dir = tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), *first, "steps=2", "checkpoint.every=2",
                 "optimizer.schedule.warmup=1", f"init.from={llama}", *data]) == 0, \
        capfd.readouterr().err
    capfd.readouterr()
    assert main(["train", "--run-dir", str(run_dir), "steps=4"]) == 0, capfd.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["start_step"], summary["steps_done"]) == (2, 4)
    assert main(["config", "show", "--run-dir", str(run_dir)]) == 0
    shown = capfd.readouterr().out.splitlines()
    assert any(line.startswith(f"  from: {llama} ") and line.endswith(f"# run: {run_dir}")
               for line in shown), shown
