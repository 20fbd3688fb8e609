"""A reinforcement-learning run that learns nothing, said once. When every group's rewards are
equal (``frac_reward_zero_std`` 1: every completion of each prompt scored the same), every
advantage is 0 and the update changes nothing; a model that never earns the reward (one that
does not answer in the form the rewards check) does that for ever, at a loss of 0, and so does
one that always earns all of it. After
``NO_SIGNAL_BATCHES`` rollout batches in a row of it (or, in a shorter run, all of them) the
console says so, with what to do."""

from __future__ import annotations

from collections.abc import Callable

from trainrun.reporting.table import Table
from trainrun.training.hooks import Hook

# Rollout batches in a row with no group that tells its completions apart before the run says
# so: a tenth of the grpo config's run, long past a stretch of bad luck on a model that learns.
NO_SIGNAL_BATCHES = 20
GUIDE = "docs/guides/reinforcement-learning.md"


class NoSignalNotice(Hook):
    """Watches ``frac_reward_zero_std`` (a rollout batch's value on each of its ``updates``
    steps) and says once, through ``say``, when it has been 1 for ``NO_SIGNAL_BATCHES``
    batches in a row, or for the ``steps`` this run takes when they are fewer."""

    every_boundary = False

    def __init__(self, updates: int, steps: int, say: Callable[[str], None]):
        self.stretch = max(min(NO_SIGNAL_BATCHES * updates, steps), 1)
        self.batches = self.stretch // updates or 1
        self.say = say
        self.run = 0  # steps in a row with no signal
        self.said = False

    def on_table(self, table: Table) -> None:
        if self.said:
            return
        spread = table.names.index("frac_reward_zero_std")
        reward = table.names.index("reward")
        for row in table.values:
            self.run = self.run + 1 if row[spread] >= 1.0 else 0
            if self.run >= self.stretch:
                self.said = True
                self.say(message(self.batches, float(row[reward])))
                return


def message(batches: int, reward: float) -> str:
    """What happened and what to do."""
    return (f"no learning signal: in each of the last {batches} rollout batches every "
            f"prompt's completions scored the same (mean reward {reward:.4g}), so every "
            "advantage is 0 and the updates change nothing. If that is the most the rewards "
            "give, the policy has learnt what they teach; if not, start from a model that "
            "already answers in the form the rewards check, right some of the time (init.from "
            f"a short fine-tune on demonstrations, as {GUIDE} shows), or give rewards that "
            "tell completions apart, a larger rl.group or a higher rl.temperature")
