"""``trainrun eval RUN_DIR``: what a trained language model scores on held-out records.

Two measures, on the run's held-out split or on the records of ``--data FILE``:

- **loss and token accuracy** over the tokens the loss counts (the answers of chat and
  completion records), as evaluation during training computes them;
- **answers**: for chat and completion records, each answer is generated from every turn
  before it (system prompt included, rendered with the run's template), in batches with the
  key/value cache, and scored: ``exact_match`` (the same text) and ``normalised_match`` (the
  same after whitespace runs become one space, the ends are stripped and case is folded).

Each record's prompt, expected and produced answer go to ``answers.jsonl`` beside the numbers
(``scores.json``), in ``RUN_DIR/eval/step-N`` unless ``--out`` names a folder. Each kind of
run scores itself (``training/kinds/``): a language run as above; a preference run on its
held-out pairs: the loss, reward accuracy and margins against the reference, in
``scores.json`` alone (it generates no answers); a reward run likewise: the loss and the
accuracy, the share of held-out pairs whose chosen answer scores higher; a
reinforcement-learning run on its held-out prompts: its answers' rewards.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainrun.data.kept_tokenizer import records_as_trained
from trainrun.storage import location
from trainrun.training.kinds import EvalAsked, EvalError, kind_of
from trainrun.training.kinds.language import ANSWER_TOKENS, held_out_loss

__all__ = ["ANSWER_TOKENS", "EvalError", "EvalResult", "default_out", "evaluate_run",
           "held_out_loss", "print_progress", "require_writable", "write_result"]

Progress = Callable[[str], None]
WRITTEN_BY = "trainrun eval"  # in scores.json: a folder eval may write into again


@dataclasses.dataclass
class EvalResult:
    """What ``evaluate_run`` found: the scores (``loss``, ``accuracy``, ``exact_match``,
    ``normalised_match``, ``answers``: how many were generated) and each answer's record;
    None where the run's evaluation generates no answers (a preference run's)."""

    step: int
    scores: dict[str, float]
    answers: list[dict[str, Any]] | None


def evaluate_run(run_dir: str | Path, *, data: str | None = None, tokens: int | None = None,
                 temperature: float = 0.0, seed: int = 0, ema: bool = False,
                 batch_size: int = 16, limit: int = 0,
                 progress: Progress | None = None) -> EvalResult:
    """The scores of the run's newest checkpoint on its held-out split, or on the records of
    ``data`` (a JSONL or Parquet file, or a folder or pattern of them). ``tokens``: the most
    tokens an answer may take (None: 64, or an RL run's ``rl.completion_tokens``); ``limit``:
    answers generated (0: one for every question or prompt)."""
    from trainrun.evaluation.sample import language_run, require_settings

    require_settings(ANSWER_TOKENS if tokens is None else tokens, temperature, seed)
    if batch_size < 1 or limit < 0:
        raise EvalError(f"--batch-size {batch_size} --limit {limit}: give a batch size of at "
                        "least 1 and a limit of 0 (every answer) or more")
    run, config = language_run(run_dir, ema, doing="eval", command="evaluate")
    config = config.model_copy(update={"data": records_as_trained(run, config.data)})
    asked = EvalAsked(data=data, ema=ema, tokens=tokens, temperature=temperature, seed=seed,
                      batch_size=batch_size, limit=limit,
                      progress=progress or (lambda line: None))
    return EvalResult(*kind_of(config).scores(config, run, asked))


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
