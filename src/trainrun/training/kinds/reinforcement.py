"""A reinforcement-learning run (the ``rl`` section): GRPO (with DAPO's and Dr. GRPO's
normalisations) on prompt records, each rollout batch drawn from the params a call starts from
and scored by the run's rewards on the host.

Its modules: the model and its loss (``models/grpo_transformer.py``,
``models/policy_gradient.py``), the completions drawn on the devices (``program/rollouts.py``,
``program/decode.py``), the prompt records and the rewards (``data/prompt_records.py``,
``data/rewards.py``; a trained reward model as one, ``training/model_reward.py``), the rollout
batches (``training/rollout_batches.py``), the completions' text
(``training/completion_text.py``), the held-out prompts' scores
(``training/held_out_rewards.py``), the notice of a run without a learning signal
(``training/no_signal.py``), the completions written (``training/completion_log.py``) and this
module. The run's rewards are loaded once (a reward file runs once a run), by the
rollout batches; its evaluations score its held-out prompts with the same ones."""

from __future__ import annotations

import dataclasses
from typing import Any

import grain
import jax
import jax.numpy as jnp

from trainrun.checkpointing import init_from
from trainrun.config import ConfigError, RecordsData, RunConfig
from trainrun.data import rewards
from trainrun.data.prompt_records import Prompt, prompt_records
from trainrun.errors import UserError
from trainrun.fast.strategies import Strategies
from trainrun.models import Model
from trainrun.models.kind_models import reinforcement_model
from trainrun.program.decode import HeadLayout
from trainrun.program.state import TrainState
from trainrun.reporting.console import Console
from trainrun.storage import location
from trainrun.training.completion_log import CompletionLog
from trainrun.training.evaluation import EvalSchedule, PromptEvaluator
from trainrun.training.held_out_rewards import reward_scores
from trainrun.training.hooks import Hook
from trainrun.training.kinds.base import (
    EvalAsked,
    HeldOutBatches,
    RunData,
    RunKind,
    Scores,
    given_data,
)
from trainrun.training.metric_log import OrderedOutput
from trainrun.training.no_signal import NoSignalNotice
from trainrun.training.rollout_batches import RolloutBatches
from trainrun.training.run_parts import Parts


class PromptsError(UserError):
    """Prompts that cannot be evaluated as asked; one line, exit 2 at the CLI."""


@dataclasses.dataclass(frozen=True)
class HeldOutPrompts:
    """The run's held-out prompts, scored by ``loaded``: the rewards its rollouts score with."""

    prompts: list[Prompt]
    loaded: list[rewards.Reward]

    def evaluator(self, config: RunConfig, parts: Parts, head: HeadLayout) -> EvalSchedule:
        """Answers to the held-out prompts scored by the run's rewards, as ``trainrun eval``
        scores them."""
        if not self.prompts:
            raise ConfigError("eval.every is set but the prompt records hold none out; give "
                              "data.eval_paths or a data.eval_fraction that leaves one out, or "
                              "set eval.every=0")
        return PromptEvaluator(config.eval.every, lambda params, step: reward_scores(
            config, params, self.prompts, loaded=self.loaded, step=step)[0])


class Reinforcement(RunKind):
    """A run with an ``rl`` section (module docstring)."""

    name = "reinforcement"
    state_holds = "the reference's params"
    generates = True

    def model(self, config: RunConfig, chosen: Strategies) -> Model:
        return reinforcement_model(config)

    def batch_size(self, config: RunConfig) -> int:
        """A rollout batch's completions: prompts x group."""
        assert config.rl is not None
        return config.rl.prompts * config.rl.group

    def data(self, config: RunConfig, parts: Parts, console: Console, given: Any,
             given_eval: grain.MapDataset | None) -> RunData:
        """Its rollout batches, drawn from the prompt records, the files they come from, and
        its held-out prompts."""
        if given is not None:
            return given_data(config, given, parts, HeldOutBatches(given_eval))
        assert config.rl is not None and isinstance(config.data, RecordsData)
        if config.init.from_ is not None:
            init_from.source_kind(init_from.source_location(config.init.from_))
        found = prompt_records(config.data, config.data.seq_len - config.rl.completion_tokens)
        if found.skipped:
            console.message(f"data: {len(found.skipped)} prompt records left out "
                            f"(data.bad_records=skip), the first: {found.skipped[0]}")
        batches = RolloutBatches(config, found.train, parts.mesh, parts.placement.rows)
        return RunData(dataset=batches, batches=batches, records=None, files=found.files,
                       held_out=HeldOutPrompts(found.eval, batches.rewards),
                       host_parts=batches.parts, follow=batches.follow)

    def hooks(self, config: RunConfig, data: RunData, output: OrderedOutput, primary: bool,
              start_step: int) -> list[Hook]:
        """The notice of a run with no learning signal, and on process 0 the sampled
        completions (``rl.log_completions``)."""
        batches = data.dataset
        if not isinstance(batches, RolloutBatches):  # data the caller gave: no rollouts
            return []
        rl = batches.rl
        hooks: list[Hook] = [NoSignalNotice(rl.updates, config.steps - start_step,
                                            output.message)]
        if primary and rl.log_completions.every:
            batches.completion_log = CompletionLog(rl, batches.texts, output.completions)
            hooks.append(batches.completion_log)
        return hooks

    def writes_completions(self, config: RunConfig) -> bool:
        return config.rl is not None and config.rl.log_completions.every > 0

    def started(self, state: TrainState) -> TrainState:
        """The reference is the params the run starts from, init.from's here."""
        if state.model_state is None:  # with LoRA: the adapters turned off
            return state
        return state.replace(model_state=jax.tree.map(  # buffers of its own: donated
            lambda p, r: jnp.array(p, r.dtype, copy=True), state.params, state.model_state))

    def scores(self, config: RunConfig, run: location.Location, asked: EvalAsked) -> Scores:
        """An answer to each held-out prompt (the first ``asked.limit``; 0: every one), scored
        by the run's rewards."""
        from trainrun.checkpointing.reader import latest_state

        wanted = held_out_prompts(config, asked.data)
        wanted = wanted[:asked.limit] if asked.limit else wanted
        step, state = latest_state(run, config, reinforcement_model(config),
                                   optimizer_state=False)
        params = state.ema if asked.ema else state.params
        scores, answers = reward_scores(config, params, wanted, temperature=asked.temperature,
                                        seed=asked.seed, batch_size=asked.batch_size,
                                        tokens=asked.tokens, step=step)
        return step, scores, answers


def held_out_prompts(config: RunConfig, data: str | None = None) -> list[Prompt]:
    """The run's held-out prompts, or every prompt of ``data``."""
    assert config.rl is not None and isinstance(config.data, RecordsData)
    section = config.data
    if data is not None:
        section = section.model_copy(update={"eval_paths": (data,), "eval_fraction": 0.0})
    found = prompt_records(section, section.seq_len - config.rl.completion_tokens).eval
    if not found:
        raise PromptsError("the run holds out no prompt (data.eval_fraction is 0 and no "
                           "data.eval_paths); give --data FILE with prompts to score")
    return found
