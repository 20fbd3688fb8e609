"""The bundles set-up builds and the loop's pieces take: the model and its program's shapes
(``Parts``), where the run's record goes (``Reporting``) and where its first call starts
(``Start``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainrun.models import Model
from trainrun.program import sharding
from trainrun.program.optim import Optimizer
from trainrun.program.precision import Policy
from trainrun.program.state import TrainState
from trainrun.reporting.console import Console
from trainrun.reporting.run_output import RunOutput
from trainrun.storage.location import LocalLocation


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parts:
    """The model and the shapes of its training program on the run's mesh, built before any
    data or state is made."""

    mesh: Any
    placement: sharding.BatchPlacement  # where a training batch goes on the mesh
    model: Model
    counted: Any  # the config's model (an analytic FLOP count), None for a model passed in
    optimizer: Optimizer
    policy: Policy
    abstract: TrainState
    state_sharding: TrainState
    init_op_by_op: bool = False  # the state at step 0 built op by op (a fast path's choice)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reporting:
    """Where the run's record goes: its folder, written by process 0, its console and its
    metric writers."""

    run_dir: LocalLocation
    primary: bool  # process 0: the one that writes files and prints
    provenance: dict[str, Any]
    console: Console
    output: RunOutput


@dataclasses.dataclass(frozen=True, kw_only=True)
class Start:
    """Where the first call starts: the state as the calls carry it, and its counters."""

    state: Any  # ``programs.carry`` of the restored or fresh state
    step: int
    nonfinite: int
