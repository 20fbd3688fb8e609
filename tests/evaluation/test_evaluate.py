"""`trainrun eval`: the held-out answers generated as a user's own loop over `generate` gets
them and scored, the loss as evaluation in training computes it, `--data` records read as the
run read its own, and an output folder that is not eval's refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import own_loop_answer

from trainrun.cli import main
from trainrun.data.tasks import task_records
from trainrun.training.answers import answer_scores, normalised, questions

pytestmark = pytest.mark.slow  # each test asks the trained chat run


def _read(out):
    scores = json.loads((out / "scores.json").read_text())
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    return scores, answers


def test_eval_scores_the_held_out_answers_as_an_own_loop_over_generate(chat_run, tmp_path,
                                                                       capsys):
    run_dir, config = chat_run
    out = tmp_path / "out"
    assert main(["eval", str(run_dir), "--tokens", "10", "--limit", "5", "--batch-size", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    scores, answers = _read(out)
    assert scores["written_by"] == "trainrun eval" and scores["step"] == 4
    # the held-out records: every 32nd of the task's records, the user turn before the answer
    every = round(1 / config.data.eval_fraction)
    held = task_records("reverse", config.data.synthetic_examples)[every - 1::every][:5]
    assert [a["prompt"] for a in answers] == [r["messages"][:1] for r in held]
    assert [a["expected"] for a in answers] == [r["messages"][1]["content"] for r in held]
    assert [a["produced"] for a in answers] == [
        own_loop_answer(run_dir, config, a["prompt"], 10) for a in answers]
    got = scores["scores"]
    assert got["answers"] == 5
    assert got["exact_match"] == np.mean([a["expected"] == a["produced"] for a in answers])
    assert np.isfinite(got["loss"]) and 0 <= got["accuracy"] <= 1
    assert "answers 5/5" in printed.err
    assert f"exact_match {got['exact_match']:.4g}" in printed.out


def test_eval_on_records_of_a_file_reads_them_as_the_run_read_its_own(chat_run, tmp_path):
    """The held-out records written to a file score as the split does; a system turn in the
    records reaches the prompt the answer is generated from."""
    run_dir, config = chat_run
    every = round(1 / config.data.eval_fraction)
    held = task_records("reverse", config.data.synthetic_examples)[every - 1::every]
    records = tmp_path / "held.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in held))
    assert main(["eval", str(run_dir), "--tokens", "6", "--out", str(tmp_path / "split")]) == 0
    assert main(["eval", str(run_dir), "--tokens", "6", "--data", str(records),
                 "--out", str(tmp_path / "file")]) == 0
    split, file = _read(tmp_path / "split"), _read(tmp_path / "file")
    assert split[0]["scores"] == pytest.approx(file[0]["scores"], rel=1e-6)
    assert [a["produced"] for a in split[1]] == [a["produced"] for a in file[1]]

    system = {"role": "system", "content": "Answer in one word."}
    with_system = tmp_path / "system.jsonl"
    with_system.write_text("".join(json.dumps({"messages": [system, *r["messages"]]}) + "\n"
                                   for r in held[:3]))
    assert main(["eval", str(run_dir), "--tokens", "4", "--data", str(with_system),
                 "--out", str(tmp_path / "system")]) == 0
    _, answers = _read(tmp_path / "system")
    assert [a["prompt"][0] for a in answers] == [system] * 3
    assert [a["produced"] for a in answers] == [
        own_loop_answer(run_dir, config, a["prompt"], 4) for a in answers]
    assert [a["produced"] for a in answers] != [
        own_loop_answer(run_dir, config, a["prompt"][1:], 4) for a in answers]


def test_an_output_folder_eval_did_not_write_is_refused_and_kept(chat_run, tmp_path, capsys):
    run_dir, _ = chat_run
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    assert main(["eval", str(run_dir), "--limit", "1", "--out", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert "holds files trainrun eval did not write" in err and len(err.splitlines()) == 1
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    link = tmp_path / "link"
    link.symlink_to(theirs)
    assert main(["eval", str(run_dir), "--limit", "1", "--out", str(link)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    # its own folder it writes again
    ours = tmp_path / "ours"
    for _ in range(2):
        assert main(["eval", str(run_dir), "--limit", "1", "--tokens", "2",
                     "--out", str(ours)]) == 0
    assert sorted(p.name for p in ours.iterdir()) == ["answers.jsonl", "scores.json"]


def test_answers_score_exact_and_normalised():
    assert normalised("  Hello\n  World ") == "hello world"
    got = answer_scores(["olleh", "Hi there", "x"], ["olleh", "hi  there\n", "y"])
    assert got == {"exact_match": pytest.approx(1 / 3), "normalised_match": pytest.approx(2 / 3)}


def test_completion_and_multi_turn_records_ask_each_answer(tmp_path):
    from trainrun.config import RecordsData

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"}]}) + "\n")
    data = RecordsData(kind="records", paths=[str(path)], eval_paths=[str(path)],
                       chat_template="chatml")
    asked = questions(data)
    assert [(len(q.prompt), q.expected) for q in asked] == [(2, "b"), (4, "d")]
    path.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    [q] = questions(data)
    assert (q.prompt, q.expected) == ("2+2=", "4")


def test_answers_scored_during_training_reach_the_metrics_and_equal_eval(tmp_path, capsys):
    from trainrun.config import load_config
    from trainrun.reporting.sinks.jsonl import read_metrics
    from trainrun.training.loop import run

    config = load_config("chat", ["steps=4", "steps_per_call=2", "model.d_model=32",
                                  "model.layers=1", "data.synthetic_examples=256",
                                  "data.batch_size=8", "eval.every=2", "eval.batch_size=8",
                                  "eval.generate=5", "eval.answer_tokens=6",
                                  "checkpoint.every=4", "optimizer.schedule.warmup=1"])
    run_dir = tmp_path / "run"
    run(config, run_dir)
    evals = read_metrics(run_dir / "metrics.jsonl", "eval")
    assert [row["step"] for row in evals] == [2, 4]
    assert all({"exact_match", "normalised_match"} <= set(row) for row in evals)
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--limit", "5", "--tokens", "6",
                 "--out", str(tmp_path / "out")]) == 0
    scores, _ = _read(tmp_path / "out")
    assert evals[-1]["exact_match"] == scores["scores"]["exact_match"]
    assert evals[-1]["normalised_match"] == scores["scores"]["normalised_match"]
    assert main(["report", str(run_dir)]) == 0
    assert "eval exact_match" in (run_dir / "report.html").read_text()


def test_answers_during_training_need_records_and_evaluations(capsys):
    assert main(["train", "--config", "lm", "eval.generate=4"]) == 2
    err = capsys.readouterr().err
    assert "eval.generate=4 generates held-out answers" in err and len(err.splitlines()) == 1


def test_eval_builds_the_run_model_once_for_the_checkpoint_and_the_loss(chat_run, monkeypatch):
    """Reading the checkpoint and scoring the held-out loss share one build of the model (each
    build traces the whole module for its shapes), and the loss is the one a model built
    apart from the checkpoint's gives."""
    import trainrun.checkpointing.reader as reader
    import trainrun.models
    import trainrun.models.kind_models as kind_models
    from trainrun.evaluation.evaluate import evaluate_run, held_out_loss

    run_dir, config = chat_run
    built: list[object] = []
    real = trainrun.models.build_model

    def counted(cfg, *args, **kwargs):
        built.append(cfg)
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(trainrun.models, "build_model", counted)
    monkeypatch.setattr(kind_models, "build_model", counted)
    result = evaluate_run(run_dir, tokens=4, limit=2)
    assert len(built) == 1
    _, state = reader.latest_state(reader.location.location(run_dir), config)
    alone = held_out_loss(config, config.data, state.params)
    assert {k: result.scores[k] for k in alone} == alone
