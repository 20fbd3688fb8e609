"""``trainrun eval`` on a preference run: its held-out pairs' loss and reward metrics against
the reference, the numbers evaluation during training gives for the same params."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from trainrun.cli import main
from trainrun.config import load_config
from trainrun.evaluation.evaluate import evaluate_run
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short DPO run, evaluated during training at its last step and checkpointed there."""
    root = tmp_path_factory.mktemp("dpo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINRUN_CACHE_DIR", str(root / "cache"))
        config = load_config("dpo", [
            "steps=4", "steps_per_call=2", "model.d_model=16", "model.layers=1",
            "data.synthetic_examples=128", "data.batch_size=4", "eval.every=4",
            "eval.batches=0", "eval.batch_size=2", "checkpoint.every=4",
            "metrics.tensorboard=false"])
        run(config, root / "run", out=io.StringIO())
    return root / "run"


@pytest.mark.slow
def test_eval_scores_a_preference_run_as_its_training_evaluation_did(
        dpo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    (during,) = read_metrics(dpo_run / "metrics.jsonl", "eval")
    result = evaluate_run(dpo_run)
    assert result.step == 4 and result.answers is None  # it generates none
    for name in ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen",
                 "logps/chosen", "logps/rejected"):
        assert result.scores[name] == pytest.approx(during[name], rel=1e-5, abs=1e-6), name
    assert result.scores["rewards/margins"] != 0.0  # trained away from the reference


@pytest.mark.slow
def test_eval_of_a_preference_run_writes_its_scores_and_no_empty_answers_file(
        dpo_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before, ``trainrun eval`` wrote an empty answers.jsonl beside the scores."""
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    out = dpo_run / "eval" / "step-4"
    out.mkdir(parents=True, exist_ok=True)  # an earlier eval, from when it wrote answers
    (out / "scores.json").write_text(json.dumps({"written_by": "trainrun eval"}))
    (out / "answers.jsonl").write_text("")
    assert main(["eval", str(dpo_run)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out / 'scores.json'}"
    assert sorted(p.name for p in out.iterdir()) == ["scores.json"]
    scores = json.loads((out / "scores.json").read_text())
    assert scores["step"] == 4 and "rewards/accuracies" in scores["scores"]
