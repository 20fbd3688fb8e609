"""A reward model in and out of Hugging Face's layout: written as the family's
``...ForSequenceClassification`` (``score.weight``, one label, ``pad_token_id``), it loads in
``transformers`` and scores every pair as trainrun scores it in its packed rows, within 1e-5, and
reads back as the same params; a language model read into a reward model leaves its output head
out and draws the score head as a fresh run draws it."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import save_tiny_causal_lm

from trainrun.checkpointing.init_from import model_of, placed_params, readers
from trainrun.config import OptimizerConfig, TransformerModel
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.models.huggingface import WeightsError, write_model_dir
from trainrun.models.reward_losses import RewardLoss
from trainrun.models.reward_transformer import (
    SCORE,
    body_config,
    body_params,
    make_reward_transformer,
    pair_rewards,
    read_positions,
)
from trainrun.models.transformer import bind_transformer
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 3
CFG = TransformerModel(vocab=64, d_model=32, layers=2, heads=4, kv_heads=2, mlp="swiglu",
                       norm="rmsnorm", positions="rope", seq_len=64, tie_embeddings=False,
                       pad_id=PAD, dropout=0.0)
PAIRS = [Pair(*(np.asarray(ids, np.uint32) for ids in pair)) for pair in (
    ([5, 17, 33], [40, 41, 2], [50, 2]),
    ([7, 8], [60, 61, PAD, 62, 2, PAD], [9, 2]),  # a pad id inside, and two at its end
    ([11, 12, 13, 14], [20, 2], [21, 22, 23, 2]),
    ([30], [31, 32, 2], [PAD, PAD]))]  # an answer of pad ids alone: read in the prompt


def _params(cfg: TransformerModel):
    model = make_reward_transformer(cfg, RewardLoss())
    params = jax.jit(model.init)(jax.random.key(7))
    return model, {**params, SCORE: params[SCORE] * 40}  # rewards far apart


def _packed_rewards(cfg: TransformerModel, params) -> np.ndarray:
    """``[pairs, 2]`` the rewards training computes of ``PAIRS`` in packed rows."""
    rows, _ = pack_pairs(PAIRS, 40, bins=1)
    read, present = read_positions(rows, cfg.pad_id)
    module = bind_transformer(body_config(cfg))(body_params(params))
    rewards = np.asarray(pair_rewards(module, params[SCORE], rows, read))
    return rewards[np.asarray(present)]


def _hf_rewards(path) -> np.ndarray:
    """``[pairs, 2]``: transformers' scores of each prompt and answer, right-padded in one
    batch with the pad id as it pads."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32).eval()
    sequences = [[*p.prompt.tolist(), *answer.tolist()] for p in PAIRS
                 for answer in (p.chosen, p.rejected)]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].numpy().reshape(-1, 2)


@pytest.mark.slow
# llama: tests/training/test_model_reward.py exports a reward run of it
@pytest.mark.parametrize("model_type", ["qwen2"])
def test_an_exported_reward_model_scores_in_transformers_as_in_trainrun(tmp_path, model_type):
    cfg = CFG if model_type == "llama" else CFG.model_copy(update={"qkv_bias": True,
                                                                   "tie_embeddings": True})
    model, params = _params(cfg)
    out = write_model_dir(jax.tree.map(np.asarray, params), cfg, tmp_path / "rm",
                          model_type=model_type)
    hf = json.loads((out / "config.json").read_text())
    kind = {"llama": "LlamaForSequenceClassification",
            "qwen2": "Qwen2ForSequenceClassification"}[model_type]
    assert hf["architectures"] == [kind] and hf["pad_token_id"] == PAD
    assert hf["id2label"] == {"0": "LABEL_0"}
    np.testing.assert_allclose(_hf_rewards(out), _packed_rewards(cfg, params), atol=1e-5)
    # read back as init.from reads it: the same params, the score head among them
    back_cfg = model_of(out)
    assert back_cfg.pad_id == PAD
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    back = placed_params(readers(str(out), back_cfg, abstract), 0, abstract, None)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_reward_model_without_a_pad_id_is_not_written_as_one_that_reads_by_it(tmp_path):
    cfg = CFG.model_copy(update={"pad_id": None})
    params = {SCORE: np.ones((1, CFG.d_model), np.float32)}  # refused before any is read
    with pytest.raises(WeightsError, match=r"model\.pad_id"):
        write_model_dir(params, cfg, tmp_path / "rm", model_type="llama")
    assert not (tmp_path / "rm").exists()


@pytest.mark.slow
def test_a_language_model_starts_a_reward_model_with_a_fresh_score_head(tmp_path):
    lm = save_tiny_causal_lm(tmp_path / "lm", "llama")  # its own output head: lm_head
    cfg = model_of(lm)
    assert not cfg.tie_embeddings
    model = make_reward_transformer(cfg, RewardLoss())
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    assert "head" not in abstract
    params = placed_params(readers(str(lm), cfg, abstract, seed=5), 5, abstract, None)
    fresh = init_state(model, build_optimizer(OptimizerConfig()), 5).params[SCORE]
    np.testing.assert_array_equal(np.asarray(params[SCORE]), np.asarray(fresh))  # a run's
    causal = transformers.AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32)
    np.testing.assert_array_equal(np.asarray(params["embed"]["embedding"]),
                                  causal.model.embed_tokens.weight.detach().numpy())
