"""The batches of a reinforcement-learning run (the ``rl`` section): each rollout batch drawn
from the current params, scored on the host, and handed to the one training step.

At step ``s`` (a multiple of ``rl.updates``) the run's ``rl.prompts`` prompts of rollout batch
``s // rl.updates`` (in an order shuffled per pass by the run's seed) get ``rl.group``
completions each, drawn with ``fold_in(state.key, s)`` (``program/rollouts.py``), so a resumed
run draws the same rollouts; every batch's prompts are left-padded to the longest prompt's
width. The rewards score them (``data/rewards.py``: called as TRL calls them, with the step as
``trainer_state``; a reward that fails or runs past ``rl.reward_timeout`` stops the run in one
line), each group's rewards become advantages (a completion no reward applies to gets 0),
and the reference's log-probabilities come from the starting params kept in the model state,
or from the params with the LoRA adapters off. The batch then serves the ``rl.updates`` steps
of one call.

The calls hand the state they start from to ``follow`` before taking their batches; the data
position (``get_state``/``set_state``) is the step, as the checkpoint keeps it. Each batch's
parts are timed (``parts``: generation, the reference pass, scoring), so a step's time counts
them beside the update; every ``rl.log_completions.every`` steps a few of the batch's
completions are kept for ``completions.jsonl`` (``completion_log``).

In a run of several processes every process draws the same rollouts (the same prompts, keys
and params, the rows split over the mesh), scores the completions of the rows its devices
hold (each call within its own time limit), and gathers every process's scores, so that each
computes the advantages of every group; its batches are its own rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trainrun.config import RLConfig, RunConfig, TransformerModel
from trainrun.data import rewards
from trainrun.data.pipeline import process_rows
from trainrun.data.prompt_records import Prompt, score_completions
from trainrun.models.grpo_transformer import Rollouts, as_bits
from trainrun.models.policy_gradient import group_advantages, zero_spread_fraction
from trainrun.program.rollouts import (
    RolloutSettings,
    draw_rollouts,
    reference_logps,
)
from trainrun.program.sharding import every_process_rows, on_host
from trainrun.program.state import TrainState
from trainrun.reporting.timing import HostParts, PartClock
from trainrun.training.completion_log import CompletionLog
from trainrun.training.completion_text import completion_text
from trainrun.training.model_reward import load_rewards

Batch = dict[str, np.ndarray]


class RolloutBatches:
    """The host iterator of a reinforcement-learning run's batches (module docstring)."""

    def __init__(self, config: RunConfig, prompts: Sequence[Prompt],
                 mesh: jax.sharding.Mesh | None = None, rows: tuple[int, int] = (0, 1)):
        assert isinstance(config.model, TransformerModel)
        self.rl, self.model, self.seed = config.tuning(RLConfig), config.model, config.seed
        self.steps = config.steps
        self.prompts = list(prompts)
        self.rewards = load_rewards(self.rl)
        self.text = completion_text(config.data, self.rl)
        self.settings = RolloutSettings(
            group=self.rl.group, tokens=self.rl.completion_tokens,
            temperature=self.rl.temperature, top_p=self.rl.top_p,
            stop_ids=self.text.stop_ids, stop_strings=self.text.stops,
            compute=config.precision.compute)
        # the longest prompt's width for every batch: one compile, and no wider than needed
        self.width = max(prompt.ids.size for prompt in self.prompts)
        self.mesh = mesh
        self.rows = rows  # (index, count): this process's rows of each batch, as it feeds them
        self.step = 0
        self.state: TrainState | None = None
        self.batch: Batch | None = None
        self.updated_since: float | None = None  # when the last batch was handed over
        self.parts = HostParts(self.rl.updates)
        self.completion_log: CompletionLog | None = None  # set where completions are written

    def follow(self, state: TrainState) -> None:
        """The state the next call starts from: its params draw the rollouts."""
        self.state = state
        self.step = int(state.step)

    def __iter__(self) -> RolloutBatches:
        return self

    def __next__(self) -> Batch:
        step, self.step = self.step, self.step + 1
        if self.batch is None or step % self.rl.updates == 0:
            self.batch = self.draw(step)
        return self.batch

    def get_state(self) -> dict[str, int]:
        return {"step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])

    def batch_prompts(self, index: int) -> list[Prompt]:
        """Rollout batch ``index``'s prompts: the next ``rl.prompts`` of an order shuffled
        per pass over the prompts by the run's seed."""
        count, per = len(self.prompts), self.rl.prompts
        chosen = []
        for at in range(index * per, (index + 1) * per):
            order = np.random.default_rng((self.seed, at // count)).permutation(count)
            chosen.append(self.prompts[int(order[at % count])])
        return chosen

    def draw(self, step: int) -> Batch:
        """The rollout batch of ``step``, drawn from the followed state's params."""
        assert self.state is not None, "follow(state) before the first batch"
        state = self.state
        jax.block_until_ready(state.params)  # the last update's end: its time is measured
        clock = PartClock()
        update_rate = self._update_rate(clock.started)
        asked = self.batch_prompts(step // self.rl.updates)
        rollouts = jax.block_until_ready(draw_rollouts(
            self.model, state.params, [p.ids for p in asked], state.key, step, self.settings,
            self.mesh, width=self.width, old_logps=self.rl.updates > 1))
        clock.mark("generation")
        reference = None
        if self.rl.beta:
            start = state.params if state.model_state is None else state.model_state
            reference = jax.block_until_ready(
                reference_logps(self.model, start, rollouts, self.settings.compute))
            clock.mark("reference")
        lengths = on_host(rollouts.completion_lengths)
        completions = on_host(rollouts.completions)  # gathered once: every process gathers
        values = self._scored(asked, completions, lengths, step)
        total = rewards.total(self.rewards, values)
        advantages = np.asarray(group_advantages(jnp.asarray(total), self.rl.group,
                                                 scale=self.rl.scale_rewards))
        seconds = max(time.perf_counter() - clock.started, 1e-9)
        # each reward's over the completions it applies to (not None), the total's over those
        # any applies to: TRL's nanmean
        metrics = [x for row in values for x in rewards.mean_and_std(row)]
        metrics += [*rewards.mean_and_std(total), zero_spread_fraction(total, self.rl.group),
                    lengths.sum() / seconds, update_rate]
        self.updated_since = time.perf_counter()
        batch = self._batch(rollouts, advantages, reference, np.asarray(metrics, np.float32))
        clock.mark("scoring")
        if self.completion_log is not None and self.completion_log.due(step):
            self.completion_log.keep(step, asked, completions, lengths, values, total,
                                     advantages)
        self.parts.add(step, clock)
        return batch

    def texts(self, ids: list[np.ndarray]) -> list[str]:
        """Completions' texts as the rewards read them (``CompletionText.texts``)."""
        return self.text.texts(ids)

    def _update_rate(self, now: float) -> float:
        """Tokens per second of the updates on the last rollout batch (0 before any)."""
        if self.updated_since is None or self.batch is None:
            return 0.0
        # the batch holds this process's rows: the updates took every process's
        tokens = self.batch["tokens"].size * self.rows[1] * self.rl.updates
        return tokens / max(now - self.updated_since, 1e-9)

    def _mine(self, total: int) -> slice:
        """This process's rows of a batch of ``total``."""
        return process_rows(total, *self.rows)

    def _scored(self, asked: list[Prompt], completions: np.ndarray, lengths: np.ndarray,
                step: int) -> np.ndarray:
        """``[rewards, rows]``: each reward of each completion (prompt ``i``'s ``group``
        completions side by side), this process's rows scored here, the others' gathered."""
        mine = range(completions.shape[0])[self._mine(completions.shape[0])]
        ids = [completions[row, :lengths[row]] for row in mine]
        texts = self.text.texts(ids)
        each = [asked[row // self.rl.group] for row in mine]
        progress = rewards.RunProgress(step, self.steps)
        return every_process_rows(score_completions(self.rewards, each, texts, ids, progress),
                                  self.rows)

    def _batch(self, rollouts: Rollouts, advantages: np.ndarray,
               reference: jax.Array | None, metrics: np.ndarray) -> Batch:
        """The columns the step takes (``grpo_transformer.make_grpo_transformer``'s), this
        process's rows of them."""
        rows = advantages.shape[0]
        old = on_host(rollouts.old_logps).astype(np.float32)
        columns = {
            "tokens": on_host(rollouts.tokens).astype(np.int32),
            "start": on_host(rollouts.start).astype(np.int32),
            "completion_mask": on_host(rollouts.completion_mask),
            "completion_lengths": on_host(rollouts.completion_lengths).astype(np.int32),
            "advantages": as_bits(advantages),
            "old_logps": as_bits(old),
            "reference_logps": as_bits(np.zeros_like(old) if reference is None
                                       else on_host(reference).astype(np.float32)),
            "host_metrics": as_bits(np.broadcast_to(metrics, (rows, metrics.size))),
        }
        mine = self._mine(rows)
        return {name: np.ascontiguousarray(column[mine]) for name, column in columns.items()}

