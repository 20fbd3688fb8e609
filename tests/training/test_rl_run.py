"""Reinforcement learning as a run, end to end: each rollout batch scored by the configured
rewards on the host (called as TRL calls them, with the run's step as ``trainer_state``), their
means and spreads, the KL to the reference (the params the run starts from), the entropy and the
speeds in the metrics; a reward that fails or does not return in time stops the run in one line
naming it; a killed run resumes bit for bit."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from trainrun import rundir
from trainrun.config import load_config
from trainrun.data.rewards import RewardError
from trainrun.data.tasks import task_records
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run

SMALL = ["steps=2", "metrics.every=1", "checkpoint.every=2", "rl.prompts=2", "rl.group=4",
         "rl.completion_tokens=8", "model.d_model=32", "model.layers=1",
         "data.synthetic_examples=64", "metrics.tensorboard=false"]

REWARDS = '''
import json


def letters(prompts, completions, log, answer, completion_ids, **fields):
    texts = [completion[0]["content"] for completion in completions]  # chat records: messages
    values = [float(sum(c.isalpha() for c in text)) for text in texts]
    with open(log, "a") as out:
        out.write(json.dumps({"values": values, "answers": answer, "prompts": prompts,
                              "lengths": [len(ids) for ids in completion_ids]}) + "\\n")
    return values


def broken(prompts, completions, **fields):
    raise ValueError("no score today")


def short(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)


def exits(prompts, completions, **fields):
    import sys
    sys.exit(0)


def progress(completions, trainer_state, **kwargs):
    """Written for TRL: the share of the run done, as TRL's trainer_state tells it."""
    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]


def hangs_from_step_2(completions, trainer_state, **kwargs):
    import time
    if trainer_state.global_step >= 2:
        time.sleep(1000)
    return [1.0 for _ in completions]
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def _rewards(*entries: dict[str, object]) -> str:
    return "rl.rewards=" + json.dumps(list(entries))


@pytest.mark.slow
def test_each_rollout_batch_reports_its_rewards_kl_entropy_and_speeds(
        tmp_path: Path, reward_file: Path, chat_run) -> None:
    log = tmp_path / "scored.jsonl"
    config = load_config("grpo", [*SMALL, "rl.beta=0.1", "optimizer.lr=0.01",
                                  f"init.from={chat_run[0]}", _rewards(
        {"name": f"{reward_file}:letters", "weight": 0.5, "args": {"log": str(log)}},
        {"name": "exact_match"})])
    run(config, tmp_path / "run", out=io.StringIO())
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    scored = [json.loads(line) for line in log.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and len(scored) == 2
    answers = {r["messages"][0]["content"]: r["messages"][1]["content"]
               for r in task_records("letter", 64)}
    for row, batch in zip(rows, scored, strict=True):
        values = np.asarray(batch["values"], np.float32)
        assert row["rewards/letters/mean"] == pytest.approx(values.mean(), rel=1e-6)
        assert row["rewards/letters/std"] == pytest.approx(values.std(), rel=1e-6)
        assert row["rewards/exact_match/mean"] <= 1.0
        total = 0.5 * values.mean() + row["rewards/exact_match/mean"]
        assert row["reward"] == pytest.approx(total, rel=1e-5)
        # each completion's record fields beside it: its prompt's own answer
        for prompt, answer in zip(batch["prompts"], batch["answers"], strict=True):
            assert answers[prompt[-1]["content"]] == answer
        assert row["completion_length"] == pytest.approx(np.mean(batch["lengths"]))
        assert row["entropy"] > 0 and 0 <= row["clip_ratio/region_mean"] <= 1
        assert row["generation_tokens_per_s"] > 0
    # the reference is the params the run started from (init.from's): no divergence at first
    assert abs(rows[0]["kl"]) < 1e-5 and rows[1]["kl"] > 1e-5
    assert rows[1]["update_tokens_per_s"] > 0


@pytest.mark.parametrize("name,words", [
    ("broken", "reward {file}:broken raised ValueError: no score today"),
    ("short", "reward {file}:short returned 7 values for 8 completions"),
    ("exits", "reward {file}:exits raised SystemExit: 0"),
])
def test_a_reward_that_fails_stops_the_run_in_one_line_naming_it(
        tmp_path: Path, reward_file: Path, name: str, words: str) -> None:
    config = load_config("grpo", [*SMALL, _rewards({"name": f"{reward_file}:{name}"})])
    with pytest.raises(RewardError) as err:
        run(config, tmp_path / "run", out=io.StringIO())
    assert words.format(file=reward_file) in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_reward_written_for_trl_reads_the_runs_step_in_training_and_evaluation(
        tmp_path: Path, reward_file: Path) -> None:
    config = load_config("grpo", [*SMALL, "steps=3", "checkpoint.every=3", "eval.every=2",
                                  _rewards({"name": f"{reward_file}:progress"})])
    run(config, tmp_path / "run", out=io.StringIO())
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # the rollouts of step s are drawn after s steps; an evaluation at s reads step s's params
    assert [(row["step"], row["rewards/progress/mean"]) for row in rows] == [
        (1, 0.0), (2, pytest.approx(1 / 3)), (3, pytest.approx(2 / 3))]
    evaluated = read_metrics(tmp_path / "run" / "metrics.jsonl", split="eval")
    assert [(row["step"], row["rewards/progress/mean"]) for row in evaluated] == [
        (2, pytest.approx(2 / 3)), (3, 1.0)]


@pytest.mark.slow
def test_a_reward_that_does_not_return_in_time_fails_the_run_in_one_line(
        cli, tmp_path: Path, reward_file: Path) -> None:
    """The reward hangs from step 2's rollouts on: the run stops in one line naming it, exit
    code 2, its status says so, and the checkpoint of step 2 is kept."""
    result = cli("train", "--config", "grpo", "--run-dir", str(tmp_path / "run"), *SMALL,
                 "steps=4", "rl.reward_timeout=2",
                 _rewards({"name": f"{reward_file}:hangs_from_step_2"}), timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    line = re.escape(f"error: reward {reward_file}:hangs_from_step_2 did not return within 2 s "
                     "(rl.reward_timeout) on the completions of data.synthetic=letter record ")
    assert re.fullmatch(line + r"\d+ and after; make it return sooner, or raise "
                        r"rl\.reward_timeout", result.stderr.strip().splitlines()[-1]), (
        result.stderr[-3000:])
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "did not return within 2 s" in status["reason"]
    assert rundir.committed_steps(tmp_path / "run" / "checkpoints") == [2]


@pytest.mark.parametrize("updates", [1, 2])
def test_old_log_probabilities_are_computed_only_for_a_loss_that_reads_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, updates: int) -> None:
    from conftest import counted_calls

    from trainrun.program import rollouts

    passes = counted_calls(monkeypatch, rollouts, "completion_logps")
    config = load_config("grpo", [*SMALL, f"rl.updates={updates}", "steps=4",
                                  f"steps_per_call={updates}", f"metrics.every={updates}",
                                  f"checkpoint.every={2 * updates}",
                                  _rewards({"name": "exact_match"})])
    run(config, tmp_path / "run", out=io.StringIO())
    # one update a rollout batch takes the ratio as 1: its forward pass would be waste
    assert len(passes) == (0 if updates == 1 else 4 // updates)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 4


def test_an_rl_run_evaluates_its_held_out_prompts_and_trains_as_without(
        tmp_path: Path) -> None:
    from trainrun.checkpointing.reader import latest_params
    from trainrun.data.prompt_records import prompt_records
    from trainrun.training.held_out_rewards import reward_scores

    common = [*SMALL, "steps=4", "rl.completion_tokens=4", _rewards({"name": "exact_match"},
              {"name": "format_regex", "args": {"pattern": "[a-m]"}})]
    evaluated = load_config("grpo", [*common, "eval.every=2"])
    run(evaluated, tmp_path / "eval", out=io.StringIO())
    run(load_config("grpo", common), tmp_path / "plain", out=io.StringIO())
    rows = read_metrics(tmp_path / "eval" / "metrics.jsonl", split="eval")
    assert [row["step"] for row in rows] == [2, 4]
    # the last evaluation is trainrun eval's scores of the last params
    held_out = prompt_records(evaluated.data, evaluated.data.seq_len - 4).eval
    step, params = latest_params(tmp_path / "eval", evaluated)
    scores, _ = reward_scores(evaluated, params, held_out)
    assert step == 4
    assert {name: rows[-1][name] for name in scores} == pytest.approx(scores, rel=1e-6)
    assert rows[-1]["answers"] == len(held_out) == 2
    # evaluating reads the params only: the training steps are the same bits
    losses = [[row["loss"] for row in read_metrics(tmp_path / name / "metrics.jsonl")]
              for name in ("eval", "plain")]
    assert losses[0] == losses[1]


def test_a_reward_file_runs_once_a_run_for_its_rollouts_and_evaluations(
        tmp_path: Path) -> None:
    loads = tmp_path / "loads.txt"
    reward = tmp_path / "loaded.py"
    reward.write_text(f"open({str(loads)!r}, 'a').write('loaded\\n')\n\n\n"
                      "def any_text(prompts, completions, **fields):\n"
                      "    return [1.0 for _ in completions]\n")
    config = load_config("grpo", [*SMALL, "steps=3", "eval.every=1",
                                  _rewards({"name": f"{reward}:any_text"})])
    run(config, tmp_path / "run", out=io.StringIO())
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl", split="eval")) == 3
    assert loads.read_text().splitlines() == ["loaded"]  # one load shared by both


def test_an_rl_run_told_to_evaluate_with_no_prompt_held_out_is_one_line(
        tmp_path: Path) -> None:
    from trainrun.config import ConfigError

    config = load_config("grpo", [*SMALL, "eval.every=2", "data.eval_fraction=0",
                                  _rewards({"name": "exact_match"})])
    with pytest.raises(ConfigError) as err:
        run(config, tmp_path / "run", out=io.StringIO())
    assert "eval.every is set but the prompt records hold none out" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


RESUMED = ["--config", "grpo", "steps=8", "checkpoint.every=4", "rl.prompts=2", "rl.group=4",
           "rl.completion_tokens=8", "model.d_model=16", "model.layers=1",
           "data.synthetic_examples=64", "optimizer.lr=0.01", "rl.beta=0.04",
           'rl.rewards=[{name: format_regex, args: {pattern: "[a-z]"}}]',
           "metrics.tensorboard=false"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["rl.updates=2", "steps_per_call=2", "metrics.every=2"],  # both kills, two updates a batch
    ["model.lora={rank: 4, targets: all-linear}", "metrics.every=1",
     "--kill-in-save", "4"],  # the reference with the adapters off; the harder kill alone
], ids=["full-two-updates", "lora"])
def test_a_killed_rl_run_resumes_bitwise(cli, tmp_path: Path, extra: list[str]) -> None:
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), *RESUMED, *extra,
                 TRAINRUN_CACHE_DIR=str(tmp_path / "cache"), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS" in result.stdout
    if "--kill-in-save" not in extra:  # the default chains: a kill in generation among them
        row = next(line for line in result.stdout.splitlines()
                   if line.startswith("kill -9 in generation after checkpoint 4"))
        # killed with its decoder running, resumed from 4: all 8 steps and the state equal
        assert row.split()[7:] == ["in", "flight", "(decoder", "running)", "4", "8", "none",
                                   "equal"], row


@pytest.mark.parametrize("config", ["lm", "dpo"])
def test_a_kill_in_generation_of_a_run_that_does_not_generate_is_refused(
        cli, tmp_path: Path, config: str) -> None:
    result = cli("verify-resume", "--work-dir", str(tmp_path / "verify"), "--config", config,
                 "--kill-in-generation", "4", TRAINRUN_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --kill-in-generation needs a reinforcement-learning run (an rl section): no "
        "other run generates while it trains"]
    assert not (tmp_path / "verify").exists() or not any((tmp_path / "verify").iterdir())


@pytest.mark.slow
def test_a_killed_rl_run_on_object_storage_resumes_bitwise(cli, tmp_path: Path,
                                                          object_store_servers) -> None:
    bucket = object_store_servers["gs"].new_bucket()
    result = cli("verify-resume", "--work-dir", f"{bucket}/verify", *RESUMED, "metrics.every=1",
                 "--kill-in-save", "4", TRAINRUN_CACHE_DIR=str(tmp_path / "cache"),
                 cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "kill -9 during async save of 4" in result.stdout and "PASS" in result.stdout
    assert not any(name.endswith(":") for name in os.listdir(tmp_path))  # no local "gs:"


@pytest.mark.slow
def test_two_processes_draw_score_and_train_as_one_process(tmp_path: Path,
                                                           reward_file: Path) -> None:
    from conftest import run_cli

    logs = {name: tmp_path / f"{name}.jsonl" for name in ("one", "two")}

    def settings(name: str) -> list[str]:
        return ["--config", "grpo", *SMALL, "steps=3", "checkpoint.every=3", "rl.beta=0.04",
                "optimizer.lr=0.01", "rl.log_completions.every=1",
                _rewards({"name": f"{reward_file}:letters",
                                               "args": {"log": str(logs[name])}})]

    single = run_cli("train", *settings("one"), "--run-dir", str(tmp_path / "one"), devices=4)
    assert single.returncode == 0, single.stderr[-3000:]
    launched = run_cli("launch", "-n", "2", "--devices-per-process", "2", "--", "train",
                       *settings("two"), "--run-dir", str(tmp_path / "two"), timeout=600)
    assert launched.returncode == 0, launched.stdout[-3000:]
    rows = {name: read_metrics(tmp_path / name / "metrics.jsonl") for name in logs}
    assert [r["step"] for r in rows["two"]] == [1, 2, 3]
    # the same rollouts and rewards; gloo sums the gradients in another order: not bitwise
    for one, two in zip(rows["one"], rows["two"], strict=True):
        assert two["reward"] == one["reward"]
        assert two["completion_length"] == one["completion_length"]
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    # each process scored its own rows, once: half a batch per call, every row in all
    scored = [json.loads(line) for line in logs["two"].read_text().splitlines()]
    assert len(scored) == 6 and all(len(batch["values"]) == 4 for batch in scored)
    assert sorted(v for b in scored for v in b["values"]) == sorted(
        v for line in logs["one"].read_text().splitlines() for v in json.loads(line)["values"])
    # the sampled completions are written once, by process 0, as by the one process
    sampled = {name: (tmp_path / name / "completions.jsonl").read_text() for name in logs}
    assert len(sampled["one"].splitlines()) == 3 * 4 and sampled["two"] == sampled["one"]


ENDING = '''
import sys
import time

calls = 0


def quits(prompts, completions, **fields):
    global calls
    calls += 1
    if calls == 2:
        sys.exit(0)
    return [0.0] * len(completions)


def hangs(prompts, completions, started, **fields):
    global calls
    calls += 1
    if calls == 2:
        open(started, "w").close()
        time.sleep(1000)
    return [0.0] * len(completions)
'''
# Three steps, each step's rollouts scored by one call of the reward, a checkpoint after each.
ENDED = [*SMALL, "steps=3", "checkpoint.every=1", "checkpoint.async=false"]


@pytest.mark.slow
def test_a_reward_that_calls_sys_exit_fails_the_run_in_one_line_keeping_its_checkpoint(
        cli, tmp_path: Path) -> None:
    rewards = tmp_path / "ending.py"
    rewards.write_text(ENDING)
    run_dir = tmp_path / "run"
    done = cli("train", "--config", "grpo", "--run-dir", str(run_dir), *ENDED,
               _rewards({"name": f"{rewards}:quits"}))
    assert done.returncode != 0, done.stdout[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "quits" in lines[0] and "SystemExit" in lines[0], lines
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 1
    assert "quits" in status["reason"] and "SystemExit" in status["reason"]
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]  # the step before, kept


@pytest.mark.slow
def test_a_hanging_reward_is_aborted_by_a_second_sigterm(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    from conftest import FAULT_STACKS, cli_env, finish

    rewards, started = tmp_path / "ending.py", tmp_path / "started"
    rewards.write_text(ENDING)
    run_dir, log = tmp_path / "run", tmp_path / "stderr.txt"
    train = subprocess.Popen(
        [sys.executable, "-m", "trainrun", "train", "--config", "grpo", "--run-dir",
         str(run_dir), *ENDED, _rewards({"name": f"{rewards}:hangs",
                                         "args": {"started": str(started)}})],
        stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True, env=cli_env(**FAULT_STACKS))
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and train.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), log.read_text()[-3000:]  # it sleeps in step 2's rollouts
        train.send_signal(signal.SIGTERM)
        while "SIGTERM received" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "(send SIGTERM again to abort at once)" in log.read_text()
        train.send_signal(signal.SIGTERM)
        finish(train, 60)
    finally:
        if train.poll() is None:  # a failed check: the reward would sleep on
            train.kill()
            train.wait()
    assert train.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert "aborted by a second SIGTERM" in log.read_text()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 1
    assert status["reason"] == ("aborted by a second SIGTERM; the last committed checkpoint is "
                                "step 1 (the same command resumes from it)")
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1"]
