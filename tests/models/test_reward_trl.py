"""trainrun's reward model against TRL's ``RewardTrainer`` on a random tiny
``...ForSequenceClassification`` from ``transformers``, read as ``init.from`` reads it: the same
pairs (token ids, packed prompt-once), and the loss, accuracy and every parameter's gradient that
``RewardTrainer.compute_loss`` gives are trainrun's, the loss and accuracy within 1e-5, with and
without margins and the centring term. With the pad token the end of text, both read each answer's
score before its final token, as transformers does."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import save_tiny_causal_lm, word_level_tokenizer

from trainrun.checkpointing.init_from import model_of, placed_params, readers
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.models.huggingface import dotted, hf_tensors
from trainrun.models.reward_losses import RewardLoss
from trainrun.models.reward_transformer import make_reward_transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

VOCAB = 96  # conftest's tiny models
PAD, END = 0, 2  # the word-level tokenizer's t0 and t2
PAIRS = [Pair(*(np.asarray(ids, np.uint32) for ids in pair), margin=margin)
         for *pair, margin in (
             ([5, 17, 33], [40, 41, 2], [50, 2], 0.5),
             ([7, 8], [60, 61, 62, 63, 2], [9, 2], 0.0),
             ([11, 12, 13, 14], [20, 2], [21, 22, 23, 2], 1.5),
             ([30], [31, 32, 2], [34, 35, 36, 37, 2], -0.25),
             ([44, 45], [46, 2], [47, 48, 2], 0.75))]


def save_tiny_reward_model(path, family: str, pad: int):
    """A random tiny ``family`` ForSequenceClassification with one label and ``pad`` as its
    pad_token_id, its score head drawn wide enough that every pair's two rewards differ."""
    lm = save_tiny_causal_lm(path / "lm", family)
    config = transformers.AutoConfig.from_pretrained(lm)
    config.num_labels, config.pad_token_id = 1, pad
    torch.manual_seed(3)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path / "rm")
    return path / "rm"


def _trl_trainer(model_dir, pad: int, coefficient: float | None) -> trl.RewardTrainer:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32)
    tokenizer = word_level_tokenizer(VOCAB)
    tokenizer.pad_token = f"t{pad}"
    args = trl.RewardConfig(output_dir=str(model_dir.parent / "trl"), use_cpu=True, bf16=False,
                            gradient_checkpointing=False, report_to=[],
                            center_rewards_coefficient=coefficient)
    dummy = {"chosen_ids": [[5, 6]], "rejected_ids": [[5, 7]]}  # the batch is below
    return trl.RewardTrainer(model=model, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_dict(dummy))


def _trl_batch(trainer: trl.RewardTrainer, margins: bool) -> dict:
    return trainer.data_collator([
        {"chosen_ids": [*p.prompt.tolist(), *p.chosen.tolist()],
         "rejected_ids": [*p.prompt.tolist(), *p.rejected.tolist()],
         **({"margin": p.margin} if margins else {})} for p in PAIRS])


def _trainrun_model(model_dir, coefficient: float | None):
    """The reward model of ``model_dir`` and its params, read as init.from reads them."""
    cfg = model_of(model_dir)
    model = make_reward_transformer(cfg, RewardLoss(coefficient))
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    return cfg, model, placed_params(readers(str(model_dir), cfg, abstract), 0, abstract, None)


def _rows(margins: bool) -> dict[str, np.ndarray]:
    pairs = PAIRS if margins else [Pair(p.prompt, p.chosen, p.rejected) for p in PAIRS]
    rows, _ = pack_pairs(pairs, 32, bins=4)
    return rows


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    return {(family, pad): save_tiny_reward_model(root / f"{family}-{pad}", family, pad)
            for family, pad in (("llama", END), ("qwen2", PAD))}


# each setting in one case or the other: the pad token the end of text or not, margins, centring
CASES = [("llama", END, True, 0.01), ("qwen2", PAD, False, None)]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "pad", "margins", "coefficient"), CASES)
def test_the_loss_accuracy_and_gradients_are_trls(reward_models, family, pad, margins,
                                                  coefficient):
    model_dir = reward_models[family, pad]
    trainer = _trl_trainer(model_dir, pad, coefficient)
    trainer.model.train()
    want = trainer.compute_loss(trainer.model, _trl_batch(trainer, margins))
    want.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    want_grads = {n: p.grad.numpy() for n, p in trainer.model.named_parameters()}

    cfg, model, params = _trainrun_model(model_dir, coefficient)
    assert cfg.pad_id == pad
    rows = _rows(margins)
    (loss, aux), grads = jax.jit(jax.value_and_grad(
        lambda p: model.loss(p, rows, jax.random.key(0))[:2], has_aux=True))(params)
    assert abs(float(loss) - float(want)) < 1e-5
    assert float(aux["weight"]) == len(PAIRS)
    assert abs(float(aux["accuracy"]) - metrics["accuracy"]) < 1e-5
    assert 0 < metrics["accuracy"] < 1  # some pairs won, some lost: the count is tested
    for name in ("margin", "min_reward", "mean_reward", "max_reward"):
        assert float(aux[name]) == pytest.approx(metrics[name], abs=1e-4), name
    grads = dict(hf_tensors(dotted(grads), cfg, family))
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        limit = 1e-4 * max(1.0, float(np.abs(want_grads[name]).max()))
        assert float(np.abs(grad - want_grads[name]).max()) <= limit, name
