"""trainrun's preference losses against TRL's ``DPOTrainer`` on a random tiny Llama from
``transformers``: the same pairs (token ids), the policy moved away from the frozen reference
it started as, and the loss and every parameter's gradient that ``DPOTrainer.compute_loss``
gives are trainrun's (cached reference column, packed pair rows): the loss within 1e-5, each
gradient within 1e-4 and within 1e-4 of its parameter's largest entry."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import save_tiny_causal_lm, word_level_tokenizer

import trainrun
from trainrun.config import PreferenceConfig
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.models.huggingface import dotted, hf_tensors
from trainrun.models.preference_transformer import (
    REFERENCE_COLUMN,
    make_preference_transformer,
    token_logps,
)
from trainrun.models.transformer import bind_transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

VOCAB = 96  # conftest's tiny models
PAIRS = [Pair(*(np.asarray(ids, np.uint32) for ids in pair)) for pair in (
    ([5, 17, 33], [40, 41, 2], [50, 2]),
    ([7, 8], [60, 61, 62, 63, 2], [9, 2]),
    ([11, 12, 13, 14], [20, 2], [21, 22, 23, 2]),
    ([30], [31, 32, 2], [34, 35, 36, 37, 2]))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The reference (the tiny Llama as saved) and the policy (it, every weight moved)."""
    root = tmp_path_factory.mktemp("trl")
    reference = save_tiny_causal_lm(root / "reference", "llama")
    policy = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.05 * torch.randn_like(param))
    policy.save_pretrained(root / "policy")
    return reference, root / "policy"


def _trl_loss_and_grads(models, settings: dict) -> tuple[float, dict[str, np.ndarray]]:
    reference_dir, policy_dir = models
    load = transformers.AutoModelForCausalLM.from_pretrained
    policy = load(policy_dir, dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(policy_dir.parent / "trl"), use_cpu=True, bf16=False,
                         gradient_checkpointing=False, report_to=[], **settings)
    dummy = {"prompt": ["t5"], "chosen": [" t6"], "rejected": [" t7"]}  # the batch is below
    trainer = trl.DPOTrainer(model=policy, ref_model=load(reference_dir, dtype=torch.float32),
                             args=args, processing_class=word_level_tokenizer(VOCAB),
                             train_dataset=datasets.Dataset.from_dict(dummy))
    batch = trainer.data_collator([{"prompt_ids": p.prompt.tolist(),
                                    "chosen_ids": p.chosen.tolist(),
                                    "rejected_ids": p.rejected.tolist()} for p in PAIRS])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {name: param.grad.numpy() for name, param in trainer.model.named_parameters()}
    return float(loss.detach()), grads


def _trainrun_loss_and_grads(models, preference: PreferenceConfig,
                             ) -> tuple[float, dict[str, np.ndarray]]:
    reference_dir, policy_dir = models
    start, policy = trainrun.load(reference_dir), trainrun.load(policy_dir)
    cfg = policy.config
    rows, _ = pack_pairs(PAIRS, 32, bins=4)
    logps = jax.jit(lambda p, b: token_logps(bind_transformer(cfg)(p), b))(start.params, rows)
    column = np.pad(np.asarray(logps), ((0, 0), (1, 0))).astype(np.float32).view(np.int32)
    batch = {**rows, REFERENCE_COLUMN: column}
    model = make_preference_transformer(cfg, preference)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: model.loss(p, batch, jax.random.key(0))[0]))(policy.params)
    return float(loss), dict(hf_tensors(dotted(grads), cfg, "llama"))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "beta", "smoothing"), [
    ("sigmoid", 0.1, 0.0), ("ipo", 0.5, 0.0), ("hinge", 0.2, 0.0), ("robust", 0.3, 0.2)])
def test_the_loss_and_gradients_are_trls(models, kind, beta, smoothing):
    want_loss, want_grads = _trl_loss_and_grads(
        models, dict(loss_type=[kind], beta=beta, label_smoothing=smoothing))
    loss, grads = _trainrun_loss_and_grads(
        models, PreferenceConfig(loss=kind, beta=beta, label_smoothing=smoothing))
    assert abs(loss - want_loss) < 1e-5
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        want = want_grads[name]
        # within 1e-4, and within 1e-4 of the parameter's largest gradient where that is small
        limit = 1e-4 * min(1.0, float(np.abs(want).max()))
        assert float(np.abs(grad - want).max()) <= limit, name
