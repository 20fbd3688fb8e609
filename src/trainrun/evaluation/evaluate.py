"""``trainrun eval RUN_DIR``: what a trained language model scores on held-out records.

Two measures, on the run's held-out split or on the records of ``--data FILE``:

- **loss and token accuracy** over the tokens the loss counts (the answers of chat and
  completion records), as evaluation during training computes them;
- **answers**: for chat and completion records, each answer is generated from every turn
  before it (system prompt included, rendered with the run's template), in batches with the
  key/value cache, and scored: ``exact_match`` (the same text) and ``normalised_match`` (the
  same after whitespace runs become one space, the ends are stripped and case is folded).

Each record's prompt, expected and produced answer go to ``answers.jsonl`` beside the numbers
(``scores.json``), in ``RUN_DIR/eval/step-N`` unless ``--out`` names a folder. A preference
run is scored on its held-out pairs instead (``preference_eval.py``): the loss, reward
accuracy and margins against the reference, in ``scores.json`` alone (it generates no
answers); a reward run likewise (``reward_eval.py``): the loss and the accuracy, the share of
held-out pairs whose chosen answer scores higher; a reinforcement-learning run on its held-out
prompts (``rl_eval.py``): its answers' rewards.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainrun.config import RecordsData, RunConfig
from trainrun.errors import UserError
from trainrun.storage import location
from trainrun.training.answers import answer_all, answer_scores, normalised, questions

if TYPE_CHECKING:  # the models are imported where a run is read
    from trainrun.models import Model

PyTree = Any
Progress = Callable[[str], None]
WRITTEN_BY = "trainrun eval"  # in scores.json: a folder eval may write into again


class EvalError(UserError):
    """An evaluation that cannot run as asked; one line, exit 2 at the CLI."""


@dataclasses.dataclass
class EvalResult:
    """What ``evaluate_run`` found: the scores (``loss``, ``accuracy``, ``exact_match``,
    ``normalised_match``, ``answers``: how many were generated) and each answer's record;
    None where the run's evaluation generates no answers (a preference run's)."""

    step: int
    scores: dict[str, float]
    answers: list[dict[str, Any]] | None


ANSWER_TOKENS = 64  # the most tokens a chat answer takes, unless told


def evaluate_run(run_dir: str | Path, *, data: str | None = None, tokens: int | None = None,
                 temperature: float = 0.0, seed: int = 0, ema: bool = False,
                 batch_size: int = 16, limit: int = 0,
                 progress: Progress | None = None) -> EvalResult:
    """The scores of the run's newest checkpoint on its held-out split, or on the records of
    ``data`` (a JSONL or Parquet file, or a folder or pattern of them). ``tokens``: the most
    tokens an answer may take (None: 64, or an RL run's ``rl.completion_tokens``); ``limit``:
    answers generated (0: one for every question or prompt)."""
    from trainrun.checkpointing.reader import latest_state
    from trainrun.evaluation.sample import language_run, require_settings
    from trainrun.fast import strategies
    from trainrun.models import build_model

    require_settings(ANSWER_TOKENS if tokens is None else tokens, temperature, seed)
    if batch_size < 1 or limit < 0:
        raise EvalError(f"--batch-size {batch_size} --limit {limit}: give a batch size of at "
                        "least 1 and a limit of 0 (every answer) or more")
    run, config = language_run(run_dir, ema, doing="eval", command="evaluate")
    if config.preference is not None:  # pairs: their loss and reward metrics, no answers
        from trainrun.evaluation.preference_eval import preference_scores

        return EvalResult(*preference_scores(config, run, data, ema), answers=None)
    if config.reward_model is not None:  # pairs: their loss and accuracy, no answers
        from trainrun.evaluation.reward_eval import reward_scores

        return EvalResult(*reward_scores(config, run, data, ema), answers=None)
    if config.rl is not None:  # prompts: their answers scored by the run's rewards
        from trainrun.evaluation.rl_eval import rl_scores

        return EvalResult(*rl_scores(config, run, data, ema, temperature=temperature,
                                     seed=seed, batch_size=batch_size, tokens=tokens,
                                     limit=limit))
    tokens = ANSWER_TOKENS if tokens is None else tokens
    section = _data_section(config, data)
    say = progress or (lambda line: None)
    # traced once, for the checkpoint and the loss alike
    chosen = strategies.chosen()
    built = build_model(config.model, attention=chosen.attention(), head=chosen.head_loss())
    step, state = latest_state(run, config, built, optimizer_state=False)
    params = state.ema if ema else state.params
    scores = held_out_loss(config, section, params, built)
    say(f"loss {scores['loss']:.4g} over the held-out tokens")
    answers: list[dict[str, Any]] = []
    if isinstance(section, RecordsData):
        from trainrun.checkpointing.run_context import run_model, within

        asked = questions(section, limit)
        model = run_model(config)  # answers within the architecture's context
        produced = answer_all(model, config.precision.compute, section, within(model, params),
                              asked, tokens, temperature=temperature, seed=seed,
                              batch_size=batch_size, progress=say,
                              head=strategies.chosen().decode_head())
        answers = [{"where": q.where, "prompt": q.prompt, "expected": q.expected,
                    "produced": p, "exact": q.expected == p,
                    "normalised": normalised(q.expected) == normalised(p)}
                   for q, p in zip(asked, produced, strict=True)]
        scores.update(answer_scores([q.expected for q in asked], produced))
        scores["answers"] = float(len(asked))
    return EvalResult(step, scores, answers)


def _data_section(config: RunConfig, data: str | None) -> Any:
    """The data section whose held-out split is evaluated: the run's, or one holding the
    records of ``data`` alone, read as the run read its records."""
    if data is None:
        return config.data
    if not isinstance(config.data, RecordsData):
        raise EvalError(f"--data reads records and the run trained on data.kind="
                        f"{config.data.kind}; evaluate it on its own held-out split (no --data)")
    return config.data.model_copy(update={"eval_paths": [data], "eval_fraction": 0.0})


def held_out_loss(config: RunConfig, section: Any, params: PyTree,
                  model: Model | None = None) -> dict[str, float]:
    """``loss`` and the model's metrics (``accuracy``: token accuracy) over the held-out split
    of ``section``, as evaluation during training computes them, in batches of the run's eval
    batch size (or fewer rows, where the split is smaller). model: the run's model
    (``build_model(config.model)``) where the caller built it already."""
    from trainrun.data import ArrayBatches, held_out_arrays
    from trainrun.data.errors import DataError
    from trainrun.models import build_model
    from trainrun.program.precision import policy_from_config
    from trainrun.training.evaluation import Evaluator

    try:
        arrays = (_file_rows(section) if section is not config.data else
                  held_out_arrays(section))
    except DataError as err:
        raise EvalError(str(err)) from None
    rows = len(next(iter(arrays.values())))
    size = min(config.eval.batch_size or config.data.batch_size, rows)
    dataset = ArrayBatches(arrays, size, shuffle=False, seed=0, split="eval")
    evaluator = Evaluator(model or build_model(config.model), dataset, every=1,
                          policy=policy_from_config(config.precision))
    return evaluator(params)


def _file_rows(section: RecordsData) -> dict[str, Any]:
    """The rows of ``section.eval_paths`` alone (the run's training records are not read)."""
    from trainrun.data import model_tokenizer
    from trainrun.data.record_rows import cached_rows, held_out_sources

    tokenizer = model_tokenizer.of_records(section)
    [(source, every)] = held_out_sources(section)
    rows = cached_rows(section, tokenizer, source, every).eval
    if rows is None:
        raise EvalError(f"{source.describe()} holds no usable record to evaluate on")
    return rows


def write_result(result: EvalResult, out: location.Location) -> list[location.Location]:
    """``scores.json`` and, where the result has answers, ``answers.jsonl`` in ``out``: a new
    or empty folder, or one an earlier ``trainrun eval`` wrote (then its files are replaced,
    and an ``answers.jsonl`` of its own that this result has none for is removed). Returns
    the files written."""
    require_writable(out)
    out.make_dirs()
    answers, scores = out / "answers.jsonl", out / "scores.json"
    if result.answers is not None:
        answers.write_text("".join(
            json.dumps(answer, ensure_ascii=False) + "\n" for answer in result.answers))
    elif answers.exists():  # an earlier eval's, of other answers: not this step's
        answers.delete()
    scores.write_text(json.dumps(
        {"written_by": WRITTEN_BY, "step": result.step, "scores": result.scores}, indent=2)
        + "\n")
    return [scores] if result.answers is None else [scores, answers]


def require_writable(out: location.Location) -> None:
    """Refused in one line: an ``out`` eval may not write into (a link, a file, a folder of
    other files)."""
    if isinstance(out, Path) and out.is_symlink():
        raise EvalError(f"--out {out} is a symbolic link; give the folder itself")
    if not out.is_dir():
        if out.exists():
            raise EvalError(f"--out {out} is a file; give a folder for scores.json and "
                            "answers.jsonl")
        return
    names = set(out.list_names())
    if not names:
        return
    try:
        ours = json.loads((out / "scores.json").read_text()).get(
            "written_by") == WRITTEN_BY
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours or not names <= {"scores.json", "answers.jsonl"}:
        raise EvalError(f"--out {out} holds files trainrun eval did not write; give a new or "
                        "empty folder")
    for name in names:
        path = out / name
        if path.is_symlink():
            raise EvalError(f"{path} is a symbolic link; trainrun eval writes no file through "
                            "one: give a new folder")


def default_out(run_dir: str | Path, step: int) -> location.Location:
    return location.location(run_dir) / "eval" / f"step-{step}"


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
