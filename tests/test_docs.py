"""The documentation site's promises: every command of the quickstart and of the fine-tuning
guide runs as written, and the generated references cover every command of the CLI and every
name of ``trainrun.__all__``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from conftest import REPO, cli_env

import trainrun
from trainrun.cli import build_parser


def hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bash_commands(page: str) -> list[str]:
    """The commands of ``page``'s ```bash blocks (a path under docs/), in order, as written:
    one per line, a line continued with a backslash joined to the next, and a heredoc
    (``<<'WORD'`` ... ``WORD``) kept with the command that reads it."""
    text = (REPO / "docs" / page).read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()  # continuation lines
    commands: list[str] = []
    while lines:
        line = lines.pop(0)
        if not line.strip() or line.startswith("#"):
            continue
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", line)
        if heredoc:
            body = []
            while lines and lines[0] != heredoc[2]:
                body.append(lines.pop(0))
            assert lines, f"heredoc {heredoc[2]} in {page} has no end"
            line = "\n".join([line, *body, lines.pop(0)])
        commands.append(line)
    return commands


def run_as_written(commands: list[str], cwd: Path) -> str:
    """Each command in a fresh bash in ``cwd``, with ``trainrun`` and this ``python`` on PATH;
    every one must exit 0. Their stdout, joined."""
    env = cli_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = []
    for command in commands:
        result = subprocess.run(["bash", "-c", command], cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        out.append(result.stdout)
    return "".join(out)


@pytest.mark.slow
def test_every_quickstart_command_runs_as_written(tmp_path):
    commands = bash_commands("quickstart.md")
    assert any(c.startswith("trainrun train") for c in commands), commands
    run_as_written(commands, tmp_path)
    # What the quickstart says they leave behind.
    assert (tmp_path / "runs" / "mlp" / "report.html").is_file()
    assert (tmp_path / "runs" / "digits" / "summary.json").is_file()


@pytest.mark.slow
def test_every_fine_tuning_command_runs_as_written(tmp_path):
    pytest.importorskip("transformers", reason="the tests' extra holds transformers")
    pytest.importorskip("peft")
    commands = bash_commands("guides/fine-tuning.md")
    assert sum(c.startswith("trainrun train") for c in commands) == 4, commands
    assert sum(c.startswith("python - <<'PY'") for c in commands) == 3, commands
    out = run_as_written(commands, tmp_path)
    # What the guide says they print and leave behind.
    for line in ("starting from params of llama-tiny (init.from) at step 0",
                 "llama-ft logits: (1, 15, 256)", "adapter and merged export agree: True",
                 "step 40 logits (1, 15, 256)", "llama-ft agrees: True",
                 "starting from params of llama-lora (init.from) at step 0"):
        assert line in out, line
    files = {name: sorted(p.name for p in (tmp_path / name).iterdir())
             for name in ("llama-ft", "llama-lora", "llama-lora-merged")}
    assert files["llama-ft"] == files["llama-lora-merged"] == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert files["llama-lora"] == [
        "adapter_config.json", "adapter_model.safetensors", "generation_config.json"]
    adapter = json.loads((tmp_path / "llama-lora" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "llama-tiny").resolve())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)


@pytest.mark.slow
def test_every_instruction_tuning_command_runs_as_written(tmp_path):
    pytest.importorskip("transformers", reason="the tests' extra holds transformers")
    pytest.importorskip("peft")
    commands = bash_commands("guides/instruction-tuning.md")
    assert sum(c.startswith("trainrun ") for c in commands) == 4, commands
    out = run_as_written(commands, tmp_path)
    # What the guide says they print and leave behind.
    assert "data: 480 records -> 480 examples (32 held out)" in out
    assert "logits (1, 25, 320)" in out
    adapter = sorted(p.name for p in (tmp_path / "sft-lora").iterdir())
    assert {"adapter_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(adapter)
    rows = [json.loads(line) for line in (tmp_path / "runs/sft/metrics.jsonl").open()]
    data_row = next(r for r in rows if r.get("split") == "data")
    assert (data_row["records"], data_row["examples"]) == (480, 480)
    assert (data_row["held_out_records"], data_row["held_out_examples"]) == (32, 32)
    assert any(r.get("split") == "eval" for r in rows)
    scores = json.loads((tmp_path / "runs/sft/eval/step-60/scores.json").read_text())
    assert scores["scores"]["answers"] == 8
    assert re.search(r"eval step 60  loss \S+  accuracy \S+ .*exact_match 0  normalised_match 0"
                     r"  answers 8", out), out[-2000:]


@pytest.mark.slow
def test_every_preference_tuning_command_runs_as_written(tmp_path):
    commands = bash_commands("guides/preference-tuning.md")
    assert [c.split()[:2] for c in commands if c.startswith("trainrun ")] == [
        ["trainrun", "train"], ["trainrun", "train"], ["trainrun", "sample"],
        ["trainrun", "eval"], ["trainrun", "export"]], commands
    out = run_as_written(commands, tmp_path)
    # What the guide says they print and leave behind.
    assert "starting from params of runs/sft (init.from) at step 0" in out
    assert "y" in out.splitlines()  # the sampled answer, ended at its turn's end
    scores = json.loads((tmp_path / "runs/dpo/eval/step-100/scores.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "runs/dpo/metrics.jsonl").open()]
    during = next(r for r in rows if r.get("split") == "eval")
    for name in ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert scores["scores"][name] == pytest.approx(during[name], rel=1e-5), name
    assert scores["scores"]["rewards/accuracies"] > 0.9
    assert (tmp_path / "dpo-model" / "model.safetensors").is_file()


def promised_reward() -> float:
    """The held-out reward the reinforcement-learning guide promises after GRPO."""
    text = (REPO / "docs/guides/reinforcement-learning.md").read_text()
    found = re.search(r"after (\d+) GRPO steps, [^:]*?it is above (\d\.\d+)", text, flags=re.S)
    assert found, "the guide's promise is not where the test reads it"
    return float(found[2])


def grpo_reward(run_dir: Path) -> float:
    """The held-out reward of a GRPO run's last params, as ``trainrun eval`` scores it."""
    from trainrun.checkpointing.reader import latest_params
    from trainrun.config import load_config
    from trainrun.training.held_out_rewards import reward_scores
    from trainrun.training.kinds.reinforcement import held_out_prompts

    config = load_config(str(run_dir / "config.yaml"))
    _, params = latest_params(run_dir, config)
    return reward_scores(config, params, held_out_prompts(config))[0]["reward"]


@pytest.mark.slow
def test_every_reinforcement_learning_command_runs_as_written(tmp_path):
    """The guide's runs as written: GRPO takes the fine-tuned model's held-out reward from at
    most 0.3 to above the figure the guide promises."""
    from trainrun.checkpointing.init_from import resolved
    from trainrun.checkpointing.reader import latest_params
    from trainrun.config import load_config
    from trainrun.training.held_out_rewards import reward_scores
    from trainrun.training.kinds.reinforcement import held_out_prompts

    commands = bash_commands("guides/reinforcement-learning.md")
    assert [c.split()[:2] for c in commands if c.startswith("trainrun ")] == [
        ["trainrun", "train"], ["trainrun", "train"], ["trainrun", "sample"],
        ["trainrun", "eval"]], commands
    out = run_as_written(commands, tmp_path)
    assert "starting from params of runs/sft (init.from) at step 0" in out
    config = resolved(load_config("grpo", [f"init.from={tmp_path / 'runs/sft'}"]))
    sft = load_config(str(tmp_path / "runs/sft/config.yaml"))
    _, start = latest_params(tmp_path / "runs/sft", sft)
    before, _ = reward_scores(config, start, held_out_prompts(config))
    assert before["reward"] <= 0.3
    last = f"step-{config.steps}"
    scores = json.loads((tmp_path / "runs/grpo/eval" / last / "scores.json").read_text())
    assert scores["scores"]["reward"] > promised_reward() and scores["scores"]["answers"] == 64
    answers = [json.loads(line) for line in
               (tmp_path / "runs/grpo/eval" / last / "answers.jsonl").open()]
    assert np.mean([a["reward"] for a in answers]) == pytest.approx(scores["scores"]["reward"])
    assert re.search(rf"eval step {config.steps}  rewards/exact_match/mean \S+  reward \S+",
                     out), out


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_reinforcement_learning_recipe_holds_on_demonstrations_of_other_seeds(tmp_path,
                                                                                 seed):
    """The guide's demonstrations drawn as it draws them with another seed, then its fine-tune
    and its GRPO as written: the held-out reward is above the figure the guide promises."""
    commands = bash_commands("guides/reinforcement-learning.md")
    demonstrations = commands[0].replace("random.Random(0)", f"random.Random({seed})")
    assert demonstrations != commands[0]
    trains = [c for c in commands if c.startswith("trainrun train")]
    run_as_written([demonstrations, *trains], tmp_path)
    assert grpo_reward(tmp_path / "runs/grpo") > promised_reward()


def test_the_reinforcement_learning_guides_trl_reward_runs_as_in_trl(tmp_path):
    """The guide's reward function, written for TRL, loaded from a file as the guide names it:
    on conversational completions and the run's progress it gives what TRL's call of it gives
    with TRL's own ``TrainerState``."""
    transformers = pytest.importorskip("transformers")
    from trainrun.data import rewards

    text = (REPO / "docs" / "guides" / "reinforcement-learning.md").read_text()
    source = next(block for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
                  if "trainer_state" in block)
    named = re.search(r"\{name: rewards\.py:(\w+),", text)
    assert named is not None
    (tmp_path / "rewards.py").write_text(source)
    reward = rewards.load(f"{tmp_path / 'rewards.py'}:{named[1]}")
    contents = ["q", "Q", "qu", "y"]
    completions = [[{"role": "assistant", "content": c}] for c in contents]
    prompts = [[{"role": "user", "content": "last qwerty"}]] * len(contents)
    ids = [[1]] * len(contents)
    for step in (10, 250):  # before half the run, and after
        found = rewards.score([reward], prompts, completions, {"completion_ids": ids},
                              ["p.jsonl:1"] * len(contents), rewards.RunProgress(step, 500))
        as_trl = reward.function(prompts=prompts, completions=completions, completion_ids=ids,
                                 trainer_state=transformers.TrainerState(global_step=step,
                                                                         max_steps=500))
        assert [None if np.isnan(v) else v for v in found[0]] == as_trl
    assert found[0].tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.slow
def test_every_tpu_command_runs_as_written(tmp_path):
    """The TPU guide's commands, here on the CPU: the device check, a run whose summary names
    the backend's start, and verify-resume passing."""
    commands = bash_commands("guides/tpu.md")
    assert [c.split()[:2] for c in commands] == [
        ["python", "-c"], ["trainrun", "train"], ["trainrun", "verify-resume"]], commands
    out = run_as_written(commands, tmp_path)
    assert re.search(r"^(cpu|tpu) \d+$", out, flags=re.M), out[:500]
    summary = json.loads((tmp_path / "runs/lm-tpu/summary.json").read_text())
    assert "backend_start" in summary["wall_time_split_s"]
    assert "PASS: every step's loss and grad_norm" in out, out[-2000:]


def test_api_page_documents_every_public_name():
    page = hooks().api_reference()
    documented = re.findall(r"^::: trainrun\.(\w+)$", page, flags=re.M)
    assert documented == list(trainrun.__all__)
    for name in trainrun.__all__:  # an entry without a docstring would be an empty heading
        assert (getattr(trainrun, name).__doc__ or "").strip(), name


def test_cli_page_covers_every_command():
    page = hooks().cli_reference()
    titles = re.findall(r"^## `(trainrun[^`]*)`$", page, flags=re.M)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, sub in commands.items():
        assert f"trainrun {name}" in titles
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in page or f", {option}" in page, (name, option)
    assert "trainrun config show" in titles and "trainrun bench ceiling" in titles
    assert "runs/&lt;config name&gt;" in page  # help text kept whole, not read as HTML


def test_the_families_the_readme_and_the_guide_list_are_those_trainrun_reads():
    """The model types the README's fine-tuning section and the fine-tuning guide's table of
    sources name, against ``models.huggingface.MODEL_TYPES``."""
    from trainrun.models.huggingface import MODEL_TYPES

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("### Fine-tuning"):]
    section = section[:section.index("directory, a")]
    guide = (root / "docs" / "guides" / "fine-tuning.md").read_text()
    row = next(line for line in guide.splitlines()
               if line.startswith("| a Hugging Face model directory"))
    for listed in (section, row):
        named = set(re.findall(r"`([a-z0-9_]+)`", listed)) - {"init.from"}
        assert named == set(MODEL_TYPES), named ^ set(MODEL_TYPES)
