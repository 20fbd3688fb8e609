"""Evaluation on the held-out split, every ``eval.every`` steps and at the end of the run.

One evaluation reads the same batches each time (the split's first ``eval.batches`` batches, in
order) and reports the mean of each metric over them: ``loss`` and the model's aux metrics
(``accuracy``, ``bits_per_byte``). It reads the params only and draws no randomness, so the
training trajectory is the same with or without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np

from trainrun.data import ArrayBatches, eval_batches
from trainrun.models import Model
from trainrun.program.precision import Policy
from trainrun.program.sharding import traced_on
from trainrun.program.step import make_eval_step
from trainrun.reporting.timing import Stopwatch
from trainrun.training.hooks import Hook
from trainrun.training.metric_log import OrderedOutput

Batch = Any


class EvalSchedule:
    """When a run evaluates: every ``every`` steps and at its last step. Calling it evaluates
    params (and the model state) of a step into named metrics."""

    every: int

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def steps_to_next(self, done: int, total: int) -> int:
        """Steps from ``done`` to the next evaluated step: a call ends there."""
        return min(self.every - done % self.every, total - done)

    def __call__(self, params: Any, model_state: Any = None, step: int = 0,
                 ) -> dict[str, float]:
        raise NotImplementedError


class Evaluator(EvalSchedule):
    """every: steps between evaluations (the last step is always evaluated).
    dataset: the held-out split, batch ``i`` at index ``i`` (this process's rows of it).
    max_batches: batches per evaluation (0: the whole split).
    put: host batch -> device batch, as the training batches are placed.
    shardings: ``(params, batch, model_state)`` shardings (the state's params and model state,
        the batch's over the mesh): each device then evaluates its own rows of every batch.
    answers: params -> scores of generated answers (``exact_match``, ...), added to each
        evaluation's metrics (``eval.generate``)."""

    def __init__(self, model: Model, dataset: grain.MapDataset, every: int, *,
                 max_batches: int = 0, policy: Policy | None = None,
                 put: Callable[[Batch], Batch] = lambda batch: batch,
                 shardings: tuple[Any, ...] | None = None,
                 answers: Callable[[Any], dict[str, float]] | None = None):
        self.every = every
        self.answers = answers
        self.dataset = dataset
        self.indices = (eval_batches(dataset, max_batches) if isinstance(dataset, ArrayBatches)
                        else list(range(max_batches or len(dataset))))
        self.put = put
        # (params, batch) shardings leave the model state (if any) replicated
        placed: dict[str, Any] = {} if shardings is None else {
            "in_shardings": (*shardings, None)[:3]}
        step = make_eval_step(model, policy)
        self.fn = jax.jit(step if shardings is None else traced_on(shardings[1].mesh, step),
                          **placed)

    def __call__(self, params: Any, model_state: Any = None, step: int = 0,
                 ) -> dict[str, float]:
        """Each metric's mean over the eval batches, weighted by what each batch's mean is
        over (examples, valid tokens, or the metric's own ``weight/<name>``), so it is the mean
        over the whole evaluated split.
        Every batch is dispatched before the one read of the results."""
        per_batch = [self.fn(params, self.put(self.dataset[i]), model_state)
                     for i in self.indices]
        rows = jax.device_get(per_batch)
        names = ["loss", *sorted(name for name in rows[0] if name not in ("loss", "weight")
                                 and not name.startswith("weight/"))]
        # A metric with its own weight (``weight/bits_per_byte``: bytes, where the loss is over
        # tokens) is combined by that one.
        metrics = {name: float(np.average([row[name] for row in rows], weights=np.array(
                       [row.get(f"weight/{name}", row["weight"]) for row in rows], np.float64)))
                   for name in names}
        return metrics if self.answers is None else {**metrics, **self.answers(params)}


class PromptEvaluator(EvalSchedule):
    """A reinforcement-learning run's evaluation: ``score`` (params, step -> metrics) answers
    its held-out prompts as ``trainrun eval`` does (greedily, scored by the run's rewards, which
    get the step as ``trainer_state.global_step``). It reads the params only and draws from no
    key of the run's."""

    def __init__(self, every: int, score: Callable[[Any, int], dict[str, float]]):
        self.every = every
        self.score = score

    def __call__(self, params: Any, model_state: Any = None, step: int = 0,
                 ) -> dict[str, float]:
        return self.score(params, step)


def eval_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """The console line of one evaluation, e.g. ``eval step 500/500  loss 0.0912  accuracy
    0.9833``."""
    width = len(str(total))
    shown = "  ".join(f"{name} {value:.4g}" for name, value in metrics.items())
    return f"eval step {step:>{width}}/{total}  {shown}"


class EvalHook(Hook):
    """Evaluates at every ``eval.every`` steps and at the run's last step (calls end there, so
    the params evaluated are those of that step); writes the results and puts them on the
    boundary for the hooks after it (callbacks, ``checkpoint.keep_best``)."""

    def __init__(self, evaluator: EvalSchedule, output: OrderedOutput, watch: Stopwatch,
                 total: int, params: str = "live"):
        self.evaluator = evaluator
        self.output = output
        self.watch = watch
        self.total = total
        self.params = params  # "live": the state's params; "ema": their moving average

    every_boundary = False  # its steps (steps_to_next) only

    def steps_to_next(self, step: int) -> int:
        return self.evaluator.steps_to_next(step, self.total)

    def at_boundary(self, boundary: Any) -> None:
        if not self.evaluator.due(boundary.step, self.total):
            return
        boundary.sync()  # train rows first: metrics.jsonl stays in step order
        with self.watch.phase("eval"):
            state = boundary.state()
            results = self.evaluator(state.ema if self.params == "ema" else state.params,
                                     state.model_state, boundary.step)
        self.output.write(boundary.step, results, "eval")
        self.output.message(eval_line(boundary.step, self.total, results))
        boundary.eval = results
