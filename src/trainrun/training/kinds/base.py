"""What a kind of run gives the rest of the code (``RunKind``), the data it hands set-up
(``RunData``), its held-out data (``HeldOut``: a value each kind owns, that makes the run's
evaluator) and what ``trainrun eval`` asks of it (``EvalAsked``, answered as ``Scores``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import grain

from trainrun.checkpointing import init_from
from trainrun.config import RunConfig, RunKindName
from trainrun.data import batch_iterator
from trainrun.data.record_rows import RecordCounts
from trainrun.errors import UserError
from trainrun.fast.strategies import Strategies
from trainrun.models import Model
from trainrun.models.kind_models import MODELS
from trainrun.program import sharding
from trainrun.program.decode import HeadLayout
from trainrun.program.state import TrainState
from trainrun.reporting.console import Console
from trainrun.reporting.timing import HostParts
from trainrun.storage import location
from trainrun.training import preflight
from trainrun.training.answers import answer_scorer
from trainrun.training.evaluation import EvalSchedule, Evaluator
from trainrun.training.hooks import Hook
from trainrun.training.metric_log import OrderedOutput
from trainrun.training.run_parts import Parts

# ``trainrun eval``'s result: the checkpoint's step, its scores, each answer's record (None:
# the kind generates none).
Scores = tuple[int, dict[str, float], list[dict[str, Any]] | None]


class EvalError(UserError):
    """An evaluation that cannot run as asked; one line, exit 2 at the CLI."""


class HeldOut(Protocol):
    """A run's held-out data, as its kind reads it: it makes the run's evaluator."""

    def evaluator(self, config: RunConfig, parts: Parts, head: HeadLayout) -> EvalSchedule:
        """The evaluation every ``eval.every`` steps; refused in one line where there is
        nothing held out to evaluate."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunData:
    """What a run trains on: ``dataset`` (a Grain dataset, pair batches, rollout batches, or
    what the caller gave), ``batches`` (this process's host batches of it), what became of its
    records (None: not counted), each file read by its content fingerprint (None: data given),
    its held-out data, the parts of a step timed on the host (None: none) and what the calls
    hand the state they start from (None: nothing)."""

    dataset: Any
    batches: Any
    records: RecordCounts | None
    files: dict[str, str] | None
    held_out: HeldOut
    host_parts: HostParts | None = None
    follow: Callable[[TrainState], None] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalAsked:
    """What ``trainrun eval`` was asked: ``data`` (a file of records to score in place of the
    held-out split), the EMA params, and how answers are generated (``tokens`` None: the
    kind's default)."""

    data: str | None
    ema: bool
    tokens: int | None
    temperature: float
    seed: int
    batch_size: int
    limit: int
    progress: Callable[[str], None]


class RunKind:
    """A kind of run (``RunConfig.kind``): its model, its data and held-out data, its hooks,
    what its state holds and ``trainrun eval``'s scores. The defaults are a run's that trains
    its model alone, on its data; each kind's module says what it does otherwise."""

    name: RunKindName
    state_holds = "model state"  # what the model state holds, as the memory check names it
    generates = False  # whether it generates while it trains (verify-resume kills it there)

    def resolved(self, config: RunConfig) -> RunConfig:
        """``config`` with what the kind reads from its data filled in (as it is: nothing)."""
        return config

    def model(self, config: RunConfig, chosen: Strategies) -> Model:
        """The model it trains (``models/kind_models.py``), on the fast paths ``chosen``."""
        return MODELS[self.name](config, None, None)

    def batch_size(self, config: RunConfig) -> int:
        """Examples per step."""
        return config.data.batch_size

    def data(self, config: RunConfig, parts: Parts, console: Console, given: Any,
             given_eval: grain.MapDataset | None) -> RunData:
        """The config's data (``given``: the caller's, taken as it is, when not None): this
        process's rows, and its held-out data (``given_eval``: the caller's held-out dataset,
        which takes its place)."""
        raise NotImplementedError

    def hooks(self, config: RunConfig, data: RunData, output: OrderedOutput, primary: bool,
              start_step: int) -> list[Hook]:
        """Its own hooks, after the metric log's and the non-finite policy's."""
        return []

    def writes_completions(self, config: RunConfig) -> bool:
        """Whether it writes ``completions.jsonl``."""
        return False

    def started(self, state: TrainState) -> TrainState:
        """``init.from``'s state made this kind's (its model state what the run keeps)."""
        return state

    def reference_pass(self, config: RunConfig) -> bool:
        """Whether a reference pass runs before training (verify-resume kills it there)."""
        return False

    def scores(self, config: RunConfig, run: location.Location, asked: EvalAsked) -> Scores:
        """``trainrun eval``'s scores of the run's newest checkpoint."""
        raise NotImplementedError


def host_batches(config: RunConfig, data: Any, parts: Parts) -> Any:
    """This process's host batches, once the data's first batch fits the model and init.from's
    source is there (a source that is not there is refused before claiming)."""
    preflight.check_batch(parts.model, data, parts.abstract.params,
                          from_config=parts.counted is not None)
    if config.init.from_ is not None:
        init_from.source_kind(init_from.source_location(config.init.from_))
    return (batch_iterator(data, config.data.prefetch_threads)
            if isinstance(data, grain.MapDataset) else iter(data))


def eval_placement(config: RunConfig, parts: Parts) -> sharding.BatchPlacement:
    """Where a held-out batch goes on the mesh: ``eval.batch_size`` rows (else the data's)."""
    return sharding.batch_placement(parts.mesh, config.eval.batch_size or config.data.batch_size,
                                    stacked=False)


def batch_evaluator(config: RunConfig, parts: Parts, dataset: grain.MapDataset,
                    placement: sharding.BatchPlacement, head: HeadLayout) -> Evaluator:
    """The evaluator of held-out batches (this process's rows, placed on the mesh as training
    batches are), with the answers of ``eval.generate``."""
    shardings = (parts.state_sharding.params, placement.sharding,
                 parts.state_sharding.model_state)
    return Evaluator(parts.model, dataset, config.eval.every, max_batches=config.eval.batches,
                     policy=parts.policy, put=placement.put, shardings=shardings,
                     answers=answer_scorer(config, head) if config.eval.generate else None)


@dataclasses.dataclass(frozen=True)
class HeldOutBatches:
    """Held-out batches: the caller's dataset, or (None) the config's held-out split."""

    dataset: grain.MapDataset | None

    def evaluator(self, config: RunConfig, parts: Parts, head: HeadLayout) -> EvalSchedule:
        from trainrun.data import build_eval_dataset

        placement = eval_placement(config, parts)
        dataset = self.dataset if self.dataset is not None else build_eval_dataset(
            config.data, placement.global_size, process_index=placement.rows[0],
            process_count=placement.rows[1])
        return batch_evaluator(config, parts, dataset, placement, head)


def given_data(config: RunConfig, data: Any, parts: Parts, held_out: HeldOut) -> RunData:
    """Data the caller gave (``trainrun.run(data=...)``), taken as it is: no records counted,
    no files fingerprinted."""
    return RunData(dataset=data, batches=host_batches(config, data, parts), records=None,
                   files=None, held_out=held_out)
