"""Preference tuning as a run, end to end: the built-in ``dpo`` config learns its held-out
pairs (reward accuracy, greedy answers) from a first step where policy and reference agree,
a killed DPO run (full fine-tune and LoRA) resumes bit for bit, pairs with no preference are
bad records, and a batch counts rows while the run says how many pairs each step trains."""

from __future__ import annotations

import io
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import REPO

from trainrun.checkpointing.reader import latest_params
from trainrun.config import load_config
from trainrun.data import model_tokenizer
from trainrun.data.tasks import task_records
from trainrun.models import build_model
from trainrun.program.decode import generate_batch
from trainrun.program.state import root_keys
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))


def _greedy_chosen(config, params) -> float:
    """The share of held-out prompts whose greedy answer is the chosen one."""
    found = model_tokenizer.load("bytes", "chatml")
    assert found.template is not None
    every = round(1 / config.data.eval_fraction)
    held = task_records("last", config.data.synthetic_examples)[every - 1::every]
    prompts = [np.asarray(found.tokenizer.encode(found.template.render(
        record["prompt"], add_generation_prompt=True, special=found.special),
        add_special_tokens=False).ids, np.int32) for record in held]
    answers = generate_batch(config.model, params, prompts, 4, temperature=0.0,
                             stop_ids=found.stop_ids)
    chosen = [record["chosen"][0]["content"] for record in held]
    produced = [found.tokenizer.decode([t for t in answer.tolist() if t not in found.stop_ids])
                for answer in answers]
    return float(np.mean([p == c for p, c in zip(produced, chosen, strict=True)]))


@pytest.mark.slow
def test_the_builtin_dpo_run_learns_its_held_out_preferences(tmp_path: Path) -> None:
    config = load_config("dpo", ["checkpoint.every=300", "metrics.tensorboard=false"])
    out = io.StringIO()
    run(config, tmp_path / "run", out=out)
    # what the guide shows the run print of its batches
    guide = (REPO / "docs" / "guides" / "preference-tuning.md").read_text()
    (said,) = [line for line in guide.splitlines() if line.startswith("data: a batch is")]
    assert said in out.getvalue().splitlines()
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["step"] == 1 and abs(first["rewards/margins"]) < 1e-6
    evals = read_metrics(tmp_path / "run" / "metrics.jsonl", "eval")
    assert evals[-1]["step"] == config.steps and evals[-1]["rewards/accuracies"] >= 0.95
    start = jax.jit(build_model(config.model).init)(root_keys(config.seed)[0])
    assert _greedy_chosen(config, start) <= 0.6
    _, trained = latest_params(tmp_path / "run", config)
    assert _greedy_chosen(config, trained) >= 0.9


SHORT = ["--config", "dpo", "steps=12", "steps_per_call=2", "checkpoint.every=4",
         "eval.every=0", "model.d_model=16", "model.layers=1", "data.synthetic_examples=128",
         "data.batch_size=4", "optimizer.schedule.warmup=2", "metrics.tensorboard=false"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    [],  # every kill: after a committed checkpoint, during a save, in the reference pass
    ["model.lora={rank: 4, targets: all-linear}", "preference.reference=in_step",
     "--kill-in-save", "8"],  # the harder kill alone
], ids=["full-cached", "lora-in-step"])
def test_a_killed_dpo_run_resumes_bitwise(cli, tmp_path: Path, extra: list[str]) -> None:
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), *SHORT, *extra,
                 TRAINRUN_CACHE_DIR=str(tmp_path / "cache"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS" in result.stdout
    # the reference column written and not committed when the kill landed, then made anew
    in_reference = [line for line in result.stdout.splitlines()
                    if line.startswith("kill -9 in the reference pass")]
    assert len(in_reference) == (0 if extra else 1)
    assert all("in flight (column written, not committed)" in line for line in in_reference)


@pytest.mark.slow
def test_a_killed_dpo_run_on_object_storage_resumes_bitwise(cli, tmp_path: Path,
                                                           object_store_servers) -> None:
    bucket = object_store_servers["s3"].new_bucket()
    result = cli("verify-resume", "--work-dir", f"{bucket}/verify", *SHORT,
                 "--kill-in-save", "8", TRAINRUN_CACHE_DIR=str(tmp_path / "cache"),
                 cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "kill -9 during async save of 8" in result.stdout and "PASS" in result.stdout
    assert not any(name.endswith(":") for name in os.listdir(tmp_path))  # no local "s3:"


@pytest.mark.parametrize("extra", [["--config", "lm"],
                                   ["--config", "dpo", "preference.reference=in_step"],
                                   ["--config", "dpo", "preference.loss=simpo"]])
def test_a_kill_in_the_reference_pass_of_a_run_without_one_is_refused(cli, tmp_path: Path,
                                                                       extra: list[str]) -> None:
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), "--kill-in-reference",
                 *extra, TRAINRUN_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --kill-in-reference needs a preference run whose loss has a reference kept "
        "before training (preference.reference=cached)"]
    assert not (tmp_path / "verify").exists() or not any((tmp_path / "verify").iterdir())


class _PastTheStateCheck(Exception):
    pass


@pytest.mark.parametrize("reference", ["in_step", "cached"])
def test_the_memory_check_counts_a_reference_the_state_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reference: str) -> None:
    from trainrun.errors import UserCodeFailed, UserError
    from trainrun.training import preflight
    from trainrun.training.kinds.preference import Preference

    def past(*_: object, **__: object) -> None:
        raise _PastTheStateCheck

    # 8.5 MiB of params, 17 MiB of Adam's moments: 30 MiB holds them, not a third copy
    monkeypatch.setattr(preflight, "_host", lambda: (30 * 2**20, " (test)", ""))
    monkeypatch.setattr(preflight, "check_model_memory", lambda *a, **k: None)
    monkeypatch.setattr(Preference, "data", past)
    config = load_config("dpo", ["steps=2", "model.d_model=256", "metrics.tensorboard=false",
                                 f"preference.reference={reference}"])
    if reference == "cached":  # the column is data: the state holds no reference
        with pytest.raises(UserCodeFailed) as past:  # raised by the test's function
            run(config, tmp_path / "run", out=io.StringIO())
        assert isinstance(past.value.__cause__, _PastTheStateCheck)
        return
    with pytest.raises(UserError) as refused:
        run(config, tmp_path / "run", out=io.StringIO())
    assert "the train state needs 34.1 MiB of host memory (params 8.5 MiB, optimizer state " \
           "17.0 MiB, the reference's params 8.5 MiB in all) and 30.0 MiB is free" in str(
               refused.value)


@pytest.mark.slow
def test_two_processes_compute_the_reference_and_train_as_one_process(tmp_path: Path) -> None:
    from conftest import run_cli

    settings = [*SHORT, "steps=4", "checkpoint.every=4", "steps_per_call=1", "metrics.every=1"]
    cache = {"TRAINRUN_CACHE_DIR": str(tmp_path / "cache")}
    single = run_cli("train", *settings, "--run-dir", str(tmp_path / "one"), devices=4,
                     **cache)
    assert single.returncode == 0, single.stderr[-3000:]
    # a cache of their own: the two processes compute the column, as on two hosts
    launched = run_cli("launch", "-n", "2", "--devices-per-process", "2", "--", "train",
                       *settings, "--run-dir", str(tmp_path / "two"), timeout=600,
                       TRAINRUN_CACHE_DIR=str(tmp_path / "cache-two"))
    assert launched.returncode == 0, launched.stdout[-3000:]
    rows = {name: read_metrics(tmp_path / name / "metrics.jsonl") for name in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == [1, 2, 3, 4]
    # the first step's loss is ln 2 in both: the column is the starting model's
    for one, two in zip(rows["one"], rows["two"], strict=True):
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
        assert two["rewards/accuracies"] == one["rewards/accuracies"]
    columns = sorted((tmp_path / "cache-two").glob("**/reference/*/train.reference_logps.bin"))
    assert len(columns) == 1


def _pairs(path: Path, count: int, same: bool = False) -> Path:
    """``count`` short pairs in TRL's standard form; ``same``: both answers the same text."""
    import json

    path.write_text("".join(json.dumps({"prompt": f"word {i}: ", "chosen": "yes",
                                        "rejected": "yes" if same else "no"}) + "\n"
                            for i in range(count)))
    return path


TINY = ["--config", "dpo", "data.synthetic=null", "model.d_model=16", "model.layers=1",
        "eval.every=0", "metrics.tensorboard=false"]


@pytest.mark.slow
def test_pairs_with_no_preference_are_refused_and_a_file_of_them_alone_is_one_line(
        cli, tmp_path: Path) -> None:
    pairs = _pairs(tmp_path / "same.jsonl", 64, same=True)
    run_dir = tmp_path / "run"
    for policy, want in (
            ("refuse", f"error: record {pairs}:1: 'chosen' and 'rejected' are the same tokens: "
                       "the pair prefers neither; fix or remove it, or set data.bad_records=skip"),
            ("skip", f"error: no preference pairs to train on in {pairs} (62 records -> 0 "
                     "examples (2 held out -> 0 examples); 64 bad records skipped; first bad: "
                     f"{pairs}:1: 'chosen' and 'rejected' are the same tokens: the pair prefers "
                     "neither); fix or replace the bad records (data.bad_records=skip left "
                     "them out)")):
        result = cli("train", *TINY, f"data.paths={pairs}", f"data.bad_records={policy}",
                     "--run-dir", str(run_dir), TRAINRUN_CACHE_DIR=str(tmp_path / "cache"))
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(want), lines
        assert not run_dir.exists()


@pytest.mark.slow
def test_a_batch_counts_rows_and_the_run_says_how_many_pairs_each_step_trains(
        cli, tmp_path: Path) -> None:
    from trainrun.data.pipeline import ArrayBatches
    from trainrun.data.preference_rows import preference_rows

    pairs = _pairs(tmp_path / "pairs.jsonl", 64)
    cache = {"TRAINRUN_CACHE_DIR": str(tmp_path / "cache")}  # the one this process uses
    refused = cli("train", *TINY, f"data.paths={pairs}", "--run-dir", str(tmp_path / "no"),
                  **cache)
    assert refused.returncode == 2
    (line,) = refused.stderr.strip().splitlines()
    config = load_config("dpo", [*TINY[2:], f"data.paths={pairs}", "data.batch_size=4",
                                 "accumulate=2", "steps=6", "steps_per_call=2",
                                 "metrics.every=1", "checkpoint.every=6"])
    rows = preference_rows(config.data, 512, 0)[0].train
    assert rows is not None
    filled = len(rows["tokens"])
    assert line == (f"error: data.batch_size=16 counts rows of packed pairs, and the 62 training "
                    f"pairs fill {filled} rows of data.seq_len + 1 tokens ({62 / filled:.1f} "
                    f"pairs a row); set data.batch_size to {filled} or less, or add pairs")
    out = io.StringIO()
    run(config, tmp_path / "run", out=out)
    assert (f"data: a batch is 4 rows (data.batch_size counts rows), each holding as many pairs "
            f"as fit: 62 pairs fill {filled} rows, {62 / filled:.1f} a row, so a step trains "
            f"about {4 * 62 / filled:,.0f} pairs") in out.getvalue()
    # each step's count is that of the pairs in the rows it drew
    batches = ArrayBatches(rows, 4, shuffle=True, seed=config.seed)
    trained = [row["pairs"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert trained == [float(batches[i]["pair_slot"].max(axis=1).sum()) for i in range(6)]
