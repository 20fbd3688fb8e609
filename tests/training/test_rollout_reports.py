"""What a reinforcement-learning run reports of its rollouts: the fraction of groups with no
reward spread (TRL's ``frac_reward_zero_std``) and the notice, said once, of a run that learns
nothing; the whole step's time and each of its parts in the summary; the mean reward on the
console; sampled completions in ``completions.jsonl``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from trainrun.config import load_config
from trainrun.models.policy_gradient import zero_spread_fraction
from trainrun.reporting.console import ConsoleLog
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.reporting.table import Table
from trainrun.reporting.timing import HostParts, PartClock, StepTimer, TimedBatch
from trainrun.training.loop import run
from trainrun.training.metrics_reader import PendingCall
from trainrun.training.no_signal import NO_SIGNAL_BATCHES, NoSignalNotice

SMALL = ["metrics.every=5", "rl.prompts=2", "rl.group=4", "rl.completion_tokens=6",
         "model.d_model=16", "model.layers=1", "data.synthetic_examples=64",
         "metrics.tensorboard=false"]

REWARDS = '''
import json


def constant(prompts, completions, **fields):
    return [0.5] * len(completions)


def _text(value):  # conversational records come as messages, as TRL passes them
    return value if isinstance(value, str) else value[-1]["content"]


def letters(prompts, completions, log, **fields):
    texts = [_text(c) for c in completions]
    values = [float(sum(c.isalpha() for c in text)) for text in texts]
    with open(log, "a") as out:
        out.write(json.dumps({"values": values, "completions": texts,
                              "prompts": [_text(p) for p in prompts]}) + "\\n")
    return values
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def _rewards(*entries: dict[str, object]) -> str:
    return "rl.rewards=" + json.dumps(list(entries))


def _said(out: str) -> int:
    return out.count("no learning signal")


# ---- no signal ---------------------------------------------------------------------------------


def test_the_fraction_of_groups_with_no_reward_spread_is_trls() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    cases = [np.asarray([1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5000001]),
             rng.integers(0, 2, 64).astype(float), np.full(32, 0.25),
             rng.normal(size=32) * 1e-9, rng.normal(size=32)]
    for rewards in cases:
        # TRL's GRPOTrainer: torch.isclose of each group's std to 0, the fraction's mean
        std = torch.tensor(rewards, dtype=torch.float32).view(-1, 4).std(dim=1)
        trl = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
        assert zero_spread_fraction(rewards, 4) == trl
    assert zero_spread_fraction(cases[0], 4) == 0.5


def _table(first: int, spread: list[float]) -> Table:
    values = np.asarray([[s, 0.0] for s in spread], np.float32)
    return Table(first, ["frac_reward_zero_std", "reward"], values)


def test_the_notice_waits_for_a_stretch_with_no_signal_and_is_said_once() -> None:
    said: list[str] = []
    notice = NoSignalNotice(updates=1, steps=500, say=said.append)
    # one batch with a group that told its completions apart restarts the count
    notice.on_table(_table(1, [1.0] * (NO_SIGNAL_BATCHES - 1) + [0.875]))
    notice.on_table(_table(NO_SIGNAL_BATCHES + 1, [1.0] * (NO_SIGNAL_BATCHES - 1)))
    assert said == []
    notice.on_table(_table(2 * NO_SIGNAL_BATCHES, [1.0] * (3 * NO_SIGNAL_BATCHES)))
    assert len(said) == 1
    assert said[0].startswith(f"no learning signal: in each of the last {NO_SIGNAL_BATCHES} "
                              "rollout batches every prompt's completions scored the same")
    assert "init.from" in said[0] and "docs/guides/reinforcement-learning.md" in said[0]


def test_a_batch_of_several_updates_counts_once_and_a_short_run_is_watched_whole() -> None:
    said: list[str] = []
    two = NoSignalNotice(updates=2, steps=500, say=said.append)
    two.on_table(_table(1, [1.0] * (2 * NO_SIGNAL_BATCHES - 1)))
    assert said == []
    two.on_table(_table(2 * NO_SIGNAL_BATCHES, [1.0]))
    assert len(said) == 1
    short = NoSignalNotice(updates=1, steps=6, say=said.append)
    short.on_table(_table(1, [1.0] * 6))
    assert len(said) == 2 and "in each of the last 6 rollout batches" in said[1]


@pytest.mark.slow
def test_a_run_whose_rewards_never_differ_says_so_once(tmp_path: Path,
                                                       reward_file: Path) -> None:
    steps = 8  # fewer than NO_SIGNAL_BATCHES: the whole run is the stretch watched
    config = load_config("grpo", [*SMALL, f"steps={steps}", "metrics.every=2",
                                  f"checkpoint.every={steps}",
                                  _rewards({"name": f"{reward_file}:constant"})])
    out = io.StringIO()
    run(config, tmp_path / "run", out=out)
    assert _said(out.getvalue()) == 1, out.getvalue()
    assert f"in each of the last {steps} rollout batches" in out.getvalue()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["frac_reward_zero_std"] for row in rows] == [1.0] * steps
    assert all(row["loss"] == 0 for row in rows)


@pytest.mark.slow
def test_a_run_with_a_reward_that_tells_completions_apart_says_nothing(
        tmp_path: Path, reward_file: Path) -> None:
    log = tmp_path / "scored.jsonl"
    config = load_config("grpo", [*SMALL, "steps=6", "checkpoint.every=6", _rewards(
        {"name": f"{reward_file}:letters", "args": {"log": str(log)}})])
    out = io.StringIO()
    run(config, tmp_path / "run", out=out)
    assert _said(out.getvalue()) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    scored = [json.loads(line)["values"] for line in log.read_text().splitlines()]
    for row, values in zip(rows, scored, strict=True):
        same = [len(set(values[i:i + 4])) == 1 for i in range(0, len(values), 4)]
        assert row["frac_reward_zero_std"] == np.mean(same)
    # the console's line shows the batch's mean reward
    line = next(text for text in out.getvalue().splitlines() if text.startswith("step 5/6"))
    assert f"reward {rows[4]['reward']:.4g}  " in line


def test_a_log_line_shows_the_mean_reward_where_there_is_one() -> None:
    out = io.StringIO()
    console = ConsoleLog(10, 8, out)
    console.line(5, {"loss": 0.25, "lr": 1e-3, "reward": 0.375}, 2.0)
    console.line(10, {"loss": 0.25, "lr": 1e-3}, 2.0)
    first, second = out.getvalue().splitlines()
    assert "lr 0.001  reward 0.375  2.0 steps/s" in first
    assert "reward" not in second


# ---- the whole step -----------------------------------------------------------------------------


def test_host_parts_are_medians_per_step_without_the_warm_up_batch() -> None:
    parts = HostParts(steps_per_batch=2)
    seconds = [{"generation": 9.0, "scoring": 1.0}, {"generation": 0.4, "scoring": 0.02},
               {"generation": 0.2, "scoring": 0.04}, {"generation": 0.3, "scoring": 0.06}]
    parts.batches = [TimedBatch(2 * i, float(i), i + 0.5, s) for i, s in enumerate(seconds)]
    assert parts.median_per_step() == pytest.approx({"generation": 0.15, "scoring": 0.02})
    assert parts.totals() == pytest.approx({"generation": 9.9, "scoring": 1.12})
    # steps 3..6 are served by the batches drawn after 2 and 4 steps
    assert parts.per_step_s(3, 6) == pytest.approx((0.4 + 0.02 + 0.2 + 0.04) / 4)
    assert parts.within(1.25, 2.25) == pytest.approx(0.25 + 0.25)


def test_an_asynchronous_window_leaves_the_batches_drawn_inside_it_out_of_its_compute() -> None:
    parts = HostParts()
    timer = StepTimer(inline=False, warmup_windows=0, host=parts)
    clock = PartClock()
    clock.started -= 0.3  # a batch drawn over the 0.3 s before now
    clock.mark("generation")
    parts.add(1, clock)
    call = PendingCall(0, 2, np.zeros(2), dispatched_at=clock.started - 0.2,
                       returned_at=clock.started - 0.1)
    window = timer.record(2, [call])
    # the window ran from the dispatch (0.2 s before the batch) to now: 0.2 s of updates
    assert window.compute_s == pytest.approx(0.2, abs=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_summary_gives_the_whole_step_and_each_part(tmp_path: Path, beta: float) -> None:
    config = load_config("grpo", [*SMALL, "steps=6", "checkpoint.every=6", f"rl.beta={beta}",
                                  _rewards({"name": "exact_match"})])
    out = io.StringIO()
    summary = run(config, tmp_path / "run", out=out)
    parts = summary.step_parts_s
    expected = ["generation", "reference", "scoring", "update"] if beta else [
        "generation", "scoring", "update"]
    assert list(parts) == expected and all(s > 0 for s in parts.values())
    step_s, steps_per_s = summary.step_time_median_s, summary.steps_per_s
    assert step_s is not None and steps_per_s is not None
    assert step_s == pytest.approx(sum(parts.values()))
    assert steps_per_s == pytest.approx(1 / step_s)
    assert summary.examples_per_s == pytest.approx(steps_per_s * 8)
    split = summary.wall_time_split_s
    assert all(split[name] > 0 for name in expected if name != "update")
    assert sum(split.values()) == pytest.approx(summary.wall_s, rel=1e-6)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["step_parts_s"] == pytest.approx(parts)
    assert "(the whole step: generation " in out.getvalue()
    assert ", update " in out.getvalue() and "FLOPs/update" in out.getvalue()
    assert not (tmp_path / "run" / "completions.jsonl").exists()  # none asked for


# ---- sampled completions ------------------------------------------------------------------------


@pytest.mark.slow
def test_sampled_completions_are_written_every_n_steps_and_cut_back_on_resume(
        tmp_path: Path, reward_file: Path) -> None:
    log = tmp_path / "scored.jsonl"
    common = [*SMALL, "rl.log_completions.every=2", "rl.log_completions.count=3",
              "checkpoint.every=2", _rewards({"name": f"{reward_file}:letters",
                                              "args": {"log": str(log)}})]
    run(load_config("grpo", [*common, "steps=4"]), tmp_path / "run", out=io.StringIO())
    path = tmp_path / "run" / "completions.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 2, 2, 4, 4, 4]
    scored = [json.loads(line) for line in log.read_text().splitlines()]
    for line in lines:
        batch = scored[line["step"] - 1]  # the batch drawn for that step
        assert line["reward"] == line["rewards"][f"{reward_file}:letters"] == \
            sum(c.isalpha() for c in line["completion"])
        advantages = []  # of each completion of the batch with this text and prompt
        for row, text in enumerate(batch["completions"]):
            if text == line["completion"] and batch["prompts"][row] in line["prompt"]:
                group = batch["values"][row // 4 * 4:row // 4 * 4 + 4]
                advantages.append((line["reward"] - np.mean(group))
                                  / (np.std(group, ddof=1) + 1e-4))
        assert line["advantage"] == pytest.approx(advantages[0], rel=1e-5, abs=1e-5)
    # the rows are spread over the batch: one of each of several prompts
    assert len({line["prompt"] for line in lines[:3]}) == 2
    # a resumed run writes each step once: lines past its checkpoint are cut back
    with path.open("a") as out:
        out.write(json.dumps({**lines[-1], "step": 5}) + "\n")
    run(load_config("grpo", [*common, "steps=6"]), tmp_path / "run", out=io.StringIO())
    resumed = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in resumed] == [2, 2, 2, 4, 4, 4, 6, 6, 6]
    assert resumed[:6] == lines


@pytest.mark.slow
def test_sampled_completions_of_a_run_on_object_storage_reach_its_bucket(
        tmp_path: Path, object_store_servers, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainrun.storage import location

    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    url = f"{object_store_servers['gs'].new_bucket()}/run"
    config = load_config("grpo", [*SMALL, "steps=2", "checkpoint.every=2",
                                  "rl.log_completions.every=1", _rewards({"name": "exact_match"})])
    run(config, url, out=io.StringIO())
    text = (location.location(url) / "completions.jsonl").read_text()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1] * 4 + [2] * 4
