"""A reward function backed by a trained reward model: ``rl.rewards``' built-in
``reward_model``, ``args: {path: ...}`` naming a reward run's directory (its newest readable
checkpoint) or a ``...ForSequenceClassification`` model directory (``trainrun export`` of a
reward run, or a reward model from the hub). The model is loaded once, when the reward is.

Each call is TRL's (``prompts``, ``completions``, other fields by keyword). Each prompt and its
completion are encoded as the reward model's training pairs encode a prompt and its chosen answer
(``data/preference_pairs.py``: the text's prompt with the tokenizer's special tokens and the
completion after it, then ``eos``; or a conversation rendered by the chat template), with the
model's tokenizer (a run's ``data.tokenizer`` and ``data.chat_template``; a model directory's
own, or ``args.tokenizer``). A sequence longer than the model's context keeps its end, where the
score is read. The sequences are scored ``batch_size`` at a time by one jitted forward pass on
this process's devices (the params on each, the rows split among them), each read at its last
token that is not the pad token (``models/reward_transformer.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainrun import rundir
from trainrun.checkpointing.init_from import model_of, placed_params, readers, source_kind
from trainrun.checkpointing.reader import latest_state, saved_config
from trainrun.checkpointing.run_context import run_model
from trainrun.config import RecordsData, RLConfig, TransformerModel
from trainrun.data import model_tokenizer, rewards
from trainrun.data.errors import DataError
from trainrun.data.kept_tokenizer import run_records_tokenizer
from trainrun.data.preference_pairs import encode_sequences
from trainrun.models.huggingface import SCORE_TENSOR, Tensors, read_config
from trainrun.models.reward_losses import RewardLoss
from trainrun.models.reward_transformer import (
    SCORE,
    body_config,
    body_params,
    make_reward_transformer,
    sequence_rewards,
)
from trainrun.models.transformer import bind_transformer
from trainrun.program.precision import DTYPES, cast_floats
from trainrun.storage import location

PyTree = Any
RewardFn = rewards.RewardFn
SHORTEST = 16  # the narrowest rows a batch is padded to; wider ones double from there


class RewardModel:
    """A reward model ready to score sequences of token ids.

    config: its transformer (``seq_len``: the longest sequence it reads); params: on this
    process's devices; tokenizer: what its pairs were encoded with; compute: the dtype it runs
    in; source: where it was loaded from, for messages."""

    def __init__(self, config: TransformerModel, params: PyTree,
                 tokenizer: model_tokenizer.ModelTokenizer, compute: str, source: str):
        self.config, self.tokenizer, self.compute, self.source = config, tokenizer, compute, source
        devices = np.asarray(jax.local_devices())
        self.mesh = Mesh(devices, ("rows",))
        self.params = jax.device_put(cast_floats(params, DTYPES[compute]),
                                     NamedSharding(self.mesh, PartitionSpec()))
        self.rows = NamedSharding(self.mesh, PartitionSpec("rows"))
        self.forward = _forward(config)  # pyright: ignore[reportArgumentType]

    def scores(self, sequences: Sequence[np.ndarray], batch_size: int = 16) -> np.ndarray:
        """float32 rewards of ``sequences`` (token ids), ``batch_size`` rows (rounded up to a
        multiple of the devices) per forward pass; a sequence longer than the context keeps
        its end."""
        if not sequences:
            return np.zeros(0, np.float32)
        devices = self.mesh.devices.size
        batch = -(-max(batch_size, 1) // devices) * devices
        kept = [np.asarray(s, np.int32)[-self.config.seq_len:] for s in sequences]
        width = min(max(SHORTEST, 1 << (max(s.size for s in kept) - 1).bit_length()),
                    self.config.seq_len)
        pad = self.config.pad_id or 0
        out = []
        for start in range(0, len(kept), batch):
            part = kept[start:start + batch]
            tokens = np.full((batch, width), pad, np.int32)
            lengths = np.ones(batch, np.int32)  # rows past the part: one pad token each
            for row, ids in enumerate(part):
                tokens[row, :ids.size], lengths[row] = ids, max(ids.size, 1)
            placed = [jax.device_put(a, self.rows) for a in (tokens, lengths)]
            out.append(np.asarray(self.forward(self.params, *placed))[:len(part)])
        return np.concatenate(out)

    def score_texts(self, prompts: Sequence[Any], completions: Sequence[Any],
                    batch_size: int = 16) -> np.ndarray:
        """The rewards of each prompt followed by its completion (texts, or lists of messages
        as TRL's conversational records hold them), encoded as the model's pairs were."""
        encoded = encode_sequences(prompts, completions, self.tokenizer)
        for where, item in enumerate(encoded):
            if isinstance(item, str):
                raise DataError(f"completion {where} cannot be scored by the reward model "
                                f"{self.source}: {item}")
        return self.scores([item for item in encoded if not isinstance(item, str)],
                           batch_size)


@functools.lru_cache(maxsize=8)
def _forward(cfg: TransformerModel) -> Callable[..., jax.Array]:
    """The jitted ``(params, tokens, lengths) -> rewards`` of reward models of ``cfg``."""
    bind = bind_transformer(body_config(cfg))

    def rewards(params: PyTree, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
        return sequence_rewards(bind(body_params(params)), params[SCORE], tokens, lengths,
                                cfg.pad_id)

    return jax.jit(rewards)


def load_reward_model(path: str, tokenizer: str | None = None,
                      chat_template: str | None = None) -> RewardModel:
    """The reward model at ``path``: a reward run's directory (local or on object storage) or
    a ``...ForSequenceClassification`` model directory. ``tokenizer``, ``chat_template``: in
    place of the model's own (``data.tokenizer`` names the forms)."""
    where = location.location(path)
    if (where / rundir.CONFIG).is_file():
        return _from_run(where, tokenizer, chat_template)
    kind = source_kind(where, what="reward_model path")
    if kind != "huggingface":
        raise DataError(f"reward_model path {path}: give a reward run's directory or a model "
                        "directory of a ...ForSequenceClassification (trainrun export of a "
                        "reward run)")
    if SCORE_TENSOR not in Tensors.of(where).names:
        raise DataError(f"reward_model path {path} holds no score head ({SCORE_TENSOR}): it is "
                        "a language model, not a reward model; give a reward model's directory")
    cfg = model_of(where, full_context=True, seq_len_key="context")
    pad = read_config(where).get("pad_token_id")
    if cfg.pad_id is None and isinstance(pad, int) and 0 <= pad < cfg.vocab:
        cfg = cfg.model_copy(update={"pad_id": pad})  # the token transformers reads past
    model = make_reward_transformer(cfg, RewardLoss())
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    params = placed_params(readers(str(where), cfg, abstract), 0, abstract, None)
    found = model_tokenizer.load(tokenizer or str(where), chat_template)
    return RewardModel(cfg, params, found, "float32", str(path))


def _from_run(run: location.Location, tokenizer: str | None,
              chat_template: str | None) -> RewardModel:
    """A reward run's model at its newest readable checkpoint, in its compute dtype."""
    config = saved_config(run)
    if config.kind != "reward" or not isinstance(config.model, TransformerModel):
        raise DataError(f"reward_model path {run} is a run that trains no reward model (it has "
                        "no reward_model section); give a reward run's directory")
    model = make_reward_transformer(config.model, RewardLoss())
    _, state = latest_state(run, config, model, optimizer_state=False)
    assert isinstance(config.data, RecordsData)  # a reward run's
    found = (model_tokenizer.load(tokenizer, chat_template) if tokenizer is not None else
             run_records_tokenizer(run, config.data, chat_template))
    return RewardModel(run_model(config, named=str(run)), state.params, found,
                       config.precision.compute, str(run))


def reward_model_reward(path: str, batch_size: int = 16, tokenizer: str | None = None,
                        chat_template: str | None = None) -> RewardFn:
    """The built-in ``reward_model``: each completion's reward by the reward model at
    ``path`` (loaded here, once), ``batch_size`` sequences per forward pass."""
    if batch_size < 1:
        raise TypeError(f"batch_size={batch_size}: give a positive number")
    model = load_reward_model(path, tokenizer, chat_template)

    def reward(prompts: Sequence[Any], completions: Sequence[Any], **fields: Any) -> list[float]:
        return [float(value) for value in
                model.score_texts(prompts, completions, batch_size)]

    return reward


# The rewards ``data/rewards.py`` cannot build on its floor, to be handed to its ``load``.
MODEL_REWARDS: dict[str, Callable[..., RewardFn]] = {"reward_model": reward_model_reward}
BUILT_IN: dict[str, Callable[..., RewardFn]] = {**rewards.BUILT_IN, **MODEL_REWARDS}


def load_rewards(rl: RLConfig) -> list[rewards.Reward]:
    """The rewards ``rl.rewards`` names (``reward_model`` among the built-ins), each call
    limited to ``rl.reward_timeout`` seconds. A run loads them once, for its rollouts and its
    evaluations alike: a reward file runs when it is loaded."""
    return rewards.load_each(rl.rewards, rl.reward_timeout, BUILT_IN)
