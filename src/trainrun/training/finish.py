"""The end of a run: every metric written and the last checkpoint committed, then the summary
(``summary.json``) and the run's status, finished or preempted."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax

from trainrun import rundir
from trainrun.training.summary import RunSummary, summarize

if TYPE_CHECKING:
    from trainrun.checkpointing.checkpoints import Checkpoints
    from trainrun.config import RunConfig
    from trainrun.program.compiled import CompiledSteps
    from trainrun.reporting.timing import Timing
    from trainrun.training.calls import CallRunner
    from trainrun.training.hooks import Boundary
    from trainrun.training.metric_log import MetricLog
    from trainrun.training.run_parts import Reporting


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finish:
    """What the end of a run closes and reads, built with the run; called with the loop's last
    boundary, it returns the run's summary."""

    config: RunConfig
    reporting: Reporting
    timing: Timing
    log: MetricLog
    calls: CallRunner
    checkpoints: Checkpoints
    programs: CompiledSteps
    counted: Any  # the config's model, for an analytic FLOP count (None: a model passed in)
    batch_size: int
    start_step: int
    streamed: bool  # metric rows streamed from the device
    wall_start: float  # ``time.perf_counter()`` when set-up began

    def __call__(self, boundary: Boundary) -> RunSummary:
        """Everything written and committed, then the summary (and the run's status)."""
        step, reporting = boundary.step, self.reporting
        if self.streamed:
            jax.effects_barrier()  # every streamed row has been written
        self.log.finish()  # every row written, the writers closed
        with self.timing.watch.phase("checkpoint"):
            self.checkpoints.wait()  # the final save is committed before the run reports done
        if boundary.preempted:
            self.checkpoints.close()
            return self._preempted(boundary)
        if boundary.stop_reason:
            reporting.console.message(f"stopped at step {step}: {boundary.stop_reason}")
        flops = self.programs.flops_per_step(self.calls.example, self.counted, self.batch_size)
        summary = summarize(self.config, boundary, time.perf_counter() - self.wall_start,
                            flops=flops, timer=self.timing.timer, watch=self.timing.watch,
                            batch_size=self.batch_size, start_step=self.start_step,
                            final_metrics=self.log.last, parts=self.timing.parts,
                            best_checkpoint=self.checkpoints.best(),
                            provenance=reporting.provenance)
        self.checkpoints.close()
        if reporting.primary:
            rundir.write_json(reporting.run_dir / rundir.SUMMARY, summary.to_dict())
            rundir.write_status(reporting.run_dir, "finished", step)
        reporting.console.message(summary.text())
        return summary

    def _preempted(self, boundary: Boundary) -> RunSummary:
        """A stopped run's summary, its status "preempted": the same command resumes it."""
        step, reporting = boundary.step, self.reporting
        if reporting.primary:
            rundir.write_status(reporting.run_dir, "preempted", step)
        reporting.console.message(f"{boundary.stop_reason} after step {step}: checkpoint saved "
                                  f"to {boundary.saved}. Run the same command to resume.")
        return RunSummary(status="preempted", steps=self.config.steps, steps_done=step,
                          start_step=self.start_step, preempted_at=step,
                          checkpoint=str(boundary.saved), provenance=reporting.provenance)
