"""GRPO's advantages and loss against TRL's ``GRPOTrainer``'s own code, on a fixed batch: the
rollouts come from a ``rollout_func`` that returns fixed token ids, the rewards from a reward
function that reads each record's ``reward`` field, and the policy's, the old and the
reference per-token log-probabilities are fixed arrays, handed to the trainer in place of its
forward pass. ``_generate_and_score_completions`` gives TRL's advantages (and, with ``beta`` >
0, its reference log-probabilities) and ``_compute_loss`` its loss; the gradient of that loss
with respect to the policy's log-probabilities comes from ``backward``. trainrun's
``group_advantages`` and ``PolicyGradientLoss`` on the same arrays equal them within 1e-6, with
the clip fractions and the KL term TRL logs. Rewards that return None where they do not apply
combine into the same advantages and reward means as TRL's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import save_tiny_causal_lm, word_level_tokenizer

from trainrun.data import rewards
from trainrun.models.policy_gradient import PolicyGradientLoss, group_advantages

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

G, LIMIT = 4, 8  # completions per prompt; dr_grpo's constant, above the longest completion
PROMPTS = [[5, 17, 33], [7, 8], [11, 12, 13, 14]]
LENGTHS = [6, 3, 1, 6, 6, 2, 5, 4, 4, 6, 3, 6]  # each completion's tokens, prompt by prompt
# the second prompt's completions all score 2: a group with no spread, advantages 0
REWARDS = np.array([1.0, 0.0, 0.5, 0.0, 2.0, 2.0, 2.0, 2.0, -1.0, 0.25, 3.0, 1.0], np.float32)
ROWS, WIDTH = len(LENGTHS), max(LENGTHS)
DRAW = np.random.default_rng(11)
COMPLETIONS = [DRAW.integers(3, 96, n).tolist() for n in LENGTHS]
LOGPS = DRAW.normal(-1.5, 0.5, (ROWS, WIDTH)).astype(np.float32)
OLD = (LOGPS + DRAW.normal(0, 0.3, (ROWS, WIDTH))).astype(np.float32)  # ratios beyond the clip
REF = (LOGPS + DRAW.normal(0, 0.2, (ROWS, WIDTH))).astype(np.float32)
MASK = np.arange(WIDTH)[None] < np.asarray(LENGTHS)[:, None]


def _rollouts(prompts: list[str], trainer: Any) -> dict[str, list[Any]]:
    """The fixed completions, each prompt's ``G`` side by side as the trainer asks for them."""
    assert len(prompts) == ROWS
    return {"prompt_ids": [PROMPTS[row // G] for row in range(ROWS)],
            "completion_ids": COMPLETIONS, "logprobs": None}


def _reward(completions: list[Any], reward: list[float], **_: Any) -> list[float]:
    return reward


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Any:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("grpo-trl") / "llama", "llama")


def _trainer(model_dir: Any, reward_funcs: Any = _reward, **settings: Any) -> Any:
    """A ``GRPOTrainer`` on the tiny Llama whose forward pass of the policy gives ``LOGPS`` (as
    a leaf that takes a gradient) and of the reference ``REF``."""
    args = trl.GRPOConfig(
        output_dir=str(model_dir.parent / "trl"), use_cpu=True, bf16=False, report_to=[],
        num_generations=G, per_device_train_batch_size=ROWS, max_completion_length=LIMIT,
        **settings)
    dummy = datasets.Dataset.from_dict({"prompt": ["t5"] * G, "reward": [0.0] * G})
    trainer = trl.GRPOTrainer(
        model=transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward_funcs, args=args, train_dataset=dummy,
        processing_class=word_level_tokenizer(96), rollout_func=_rollouts)
    trainer.policy_logps = torch.tensor(LOGPS, requires_grad=True)

    def logps_and_entropies(model: Any, input_ids: Any, *_: Any, **__: Any) -> tuple[Any, ...]:
        assert input_ids.shape[1] == max(map(len, PROMPTS)) + WIDTH  # the rollouts' text
        found = torch.tensor(REF) if model is trainer.ref_model else trainer.policy_logps
        return found, torch.zeros(ROWS, WIDTH), None

    trainer._get_per_token_logps_and_entropies = logps_and_entropies
    trainer.current_gradient_accumulation_steps = 1  # as the training loop sets it
    trainer.model.train()
    return trainer


def _trl(model_dir: Any, old: np.ndarray | None, **settings: Any,
         ) -> tuple[np.ndarray, float, np.ndarray, dict[str, float]]:
    """TRL's advantages, loss, its gradient to the policy's log-probabilities and metrics."""
    trainer = _trainer(model_dir, **settings)
    records = [{"prompt": " ".join(f"t{i}" for i in PROMPTS[row // G]),
                "reward": float(REWARDS[row])} for row in range(ROWS)]
    inputs = trainer._generate_and_score_completions(records)
    assert torch.equal(inputs["completion_mask"].bool(), torch.from_numpy(MASK))
    if old is not None:  # the params that drew the rollouts, a few updates back
        inputs["old_per_token_logps"] = torch.from_numpy(old)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return (inputs["advantages"].numpy(), float(loss.detach()),
            trainer.policy_logps.grad.numpy(), metrics)


def _trainrun(objective: PolicyGradientLoss, old: np.ndarray | None, scale: bool,
              ) -> tuple[np.ndarray, float, np.ndarray, dict[str, float]]:
    advantages = group_advantages(jnp.asarray(REWARDS), G, scale=scale)
    old_logps = None if old is None else jnp.asarray(old)

    def loss(logps: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return objective(logps, advantages, jnp.asarray(MASK), old_logps, jnp.asarray(REF))

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(LOGPS))
    return (np.asarray(advantages), float(value), np.asarray(grad),
            {name: float(v) for name, v in metrics.items()})


CASES = [  # normalisation, beta, (clip low, clip high), old log-probabilities, scaled rewards
    *[(kind, beta, (0.2, 0.28), OLD, True)
      for kind in ("grpo", "dapo", "dr_grpo") for beta in (0.0, 0.04)],
    ("dapo", 0.0, (0.2, 0.2), None, True),  # one update per rollout batch: the ratio is 1
    ("grpo", 0.04, (0.1, 0.3), None, False),
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")
@pytest.mark.parametrize(("normalisation", "beta", "clip", "old", "scale"), CASES)
def test_advantages_loss_and_gradient_are_trls(model_dir, normalisation, beta, clip, old,
                                               scale) -> None:
    want_advantages, want_loss, want_grad, want_metrics = _trl(
        model_dir, old, loss_type=normalisation, beta=beta, epsilon=clip[0],
        epsilon_high=clip[1], scale_rewards="group" if scale else "none")
    objective = PolicyGradientLoss(normalisation, clip_low=clip[0], clip_high=clip[1],
                                   beta=beta, max_completion_tokens=LIMIT)
    advantages, loss, grad, metrics = _trainrun(objective, old, scale)
    np.testing.assert_allclose(advantages, want_advantages, rtol=0, atol=1e-6)
    assert abs(loss - want_loss) <= 1e-6
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-6)
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    for name in names + (["kl"] if beta else []):
        assert abs(metrics[name] - want_metrics[name]) <= 1e-6, name
    if old is not None:  # the batch exercises both clips, so a wrong one would show
        assert want_metrics["clip_ratio/low_mean"] > 0 and want_metrics["clip_ratio/high_mean"] > 0


# None where a reward does not apply: a completion neither applies to in the first and the third
# group, and in the second only one of the four has a reward (no spread: advantages 0)
FIRST = [1.0, None, 0.5, None, None, None, None, None, -1.0, 0.25, None, 1.0]
SECOND = [None, 0.0, 2.0, None, None, None, 3.0, None, 0.5, None, None, 2.0]
WEIGHTS = (1.0, 0.5)


def first(completions: list[Any], first: list[float | None], **_: Any) -> list[float | None]:
    return first


def second(completions: list[Any], second: list[float | None], **_: Any) -> list[float | None]:
    return second


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You are using 'rollout_func'")
def test_rewards_that_return_none_combine_as_trls(model_dir) -> None:
    trainer = _trainer(model_dir, [first, second], reward_weights=list(WEIGHTS))
    records = [{"prompt": " ".join(f"t{i}" for i in PROMPTS[row // G]), "first": FIRST[row],
                "second": SECOND[row]} for row in range(ROWS)]
    want = trainer._generate_and_score_completions(records)["advantages"].numpy()
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    found = [rewards.Reward("first", first, WEIGHTS[0]),
             rewards.Reward("second", second, WEIGHTS[1])]
    values = rewards.score(found, [r["prompt"] for r in records], ["c"] * ROWS,
                           {"first": FIRST, "second": SECOND,
                            "completion_ids": COMPLETIONS}, [f"r:{row}" for row in range(ROWS)])
    with pytest.warns(rewards.UnscoredWarning):
        total = rewards.total(found, values)
    advantages = np.asarray(group_advantages(jnp.asarray(total), G))
    np.testing.assert_allclose(advantages, want, rtol=0, atol=1e-6)
    assert np.count_nonzero(want) == 6  # the unscored and the lone one's are 0
    assert rewards.mean_and_std(total)[0] == pytest.approx(logged["reward"], abs=1e-6)
    for name, row in zip(("first", "second"), values, strict=True):
        mean = rewards.mean_and_std(row)[0]
        assert mean == pytest.approx(logged[f"rewards/{name}/mean"], abs=1e-6), name
