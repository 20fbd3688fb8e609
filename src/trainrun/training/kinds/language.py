"""A language run: next-token training of the ``model`` section's model on text or records
(supervised on chat and completion records: the loss over the answers), no tuning section.

Its data is the config's (``data/``: Grain's pipeline), its held-out data the split the data
section leaves out (``HeldOutBatches``), evaluated for the loss and the model's metrics, and
with ``eval.generate`` the answers to held-out questions. ``trainrun eval`` scores the newest
checkpoint likewise (``held_out_loss``), and answers every held-out question of chat and
completion records."""

from __future__ import annotations

from typing import Any

import grain

from trainrun.config import RecordsData, RunConfig
from trainrun.data import build_dataset, data_counts, data_files, data_notices
from trainrun.fast.strategies import Strategies
from trainrun.models import Model
from trainrun.models.kind_models import language_model
from trainrun.reporting.console import Console
from trainrun.storage import location
from trainrun.training import preflight
from trainrun.training.kinds.base import (
    EvalAsked,
    EvalError,
    HeldOutBatches,
    RunData,
    RunKind,
    Scores,
    given_data,
    host_batches,
)
from trainrun.training.run_parts import Parts

PyTree = Any


class Language(RunKind):
    """A run with no tuning section (module docstring)."""

    name = "language"

    def model(self, config: RunConfig, chosen: Strategies) -> Model:
        return language_model(config, chosen.attention(), chosen.head_loss())

    def data(self, config: RunConfig, parts: Parts, console: Console, given: Any,
             given_eval: grain.MapDataset | None) -> RunData:
        held_out = HeldOutBatches(given_eval)
        if given is not None:
            return given_data(config, given, parts, held_out)
        rows = parts.placement.rows
        data = build_dataset(config.data, seed=config.seed, process_index=rows[0],
                             process_count=rows[1])
        for notice in data_notices(config.data):
            console.message(notice)
        records = data_counts(config.data)
        if records is not None:
            preflight.check_vocab(records.vocab, config.model, config.data,
                                  config.init.model_source)
        return RunData(dataset=data, batches=host_batches(config, data, parts), records=records,
                       files=data_files(config.data), held_out=held_out)

    def scores(self, config: RunConfig, run: location.Location, asked: EvalAsked) -> Scores:
        from trainrun.checkpointing.reader import latest_state
        from trainrun.checkpointing.run_context import run_model, within
        from trainrun.fast import strategies
        from trainrun.training.answers import answer_all, answer_scores, normalised, questions

        section = data_section(config, asked.data)
        # traced once, for the checkpoint and the loss alike
        chosen = strategies.chosen()
        built = self.model(config, chosen)
        step, state = latest_state(run, config, built, optimizer_state=False)
        params = state.ema if asked.ema else state.params
        scores = held_out_loss(config, section, params, built)
        asked.progress(f"loss {scores['loss']:.4g} over the held-out tokens")
        if not isinstance(section, RecordsData):
            return step, scores, []
        wanted = questions(section, asked.limit)
        model = run_model(config)  # answers within the architecture's context
        produced = answer_all(model, config.precision.compute, section, within(model, params),
                              wanted, ANSWER_TOKENS if asked.tokens is None else asked.tokens,
                              temperature=asked.temperature, seed=asked.seed,
                              batch_size=asked.batch_size, progress=asked.progress,
                              head=chosen.decode_head())
        answers = [{"where": q.where, "prompt": q.prompt, "expected": q.expected,
                    "produced": p, "exact": q.expected == p,
                    "normalised": normalised(q.expected) == normalised(p)}
                   for q, p in zip(wanted, produced, strict=True)]
        scores.update(answer_scores([q.expected for q in wanted], produced))
        scores["answers"] = float(len(wanted))
        return step, scores, answers


ANSWER_TOKENS = 64  # the most tokens a chat answer takes, unless told


def data_section(config: RunConfig, data: str | None) -> Any:
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
    batch size (or fewer rows, where the split is smaller). model: the run's model where the
    caller built it already."""
    from trainrun.data import ArrayBatches, held_out_arrays
    from trainrun.data.errors import DataError
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
    evaluator = Evaluator(model or language_model(config), dataset, every=1,
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
