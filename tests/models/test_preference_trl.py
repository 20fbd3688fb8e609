"""trainrun's preference losses against TRL's ``DPOTrainer`` on a random tiny Llama from
``transformers``: the same pairs (token ids), the policy moved away from the frozen reference
it started as, and the loss and every parameter's gradient that ``DPOTrainer.compute_loss``
gives are trainrun's (cached reference column, packed pair rows): the loss within 1e-5, each
gradient within 1e-4 and within 1e-4 of its parameter's largest entry. Pairs with no preference
add no win, as TRL's ties do not."""

from __future__ import annotations

import json

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
    pair_logps,
)
from trainrun.models.token_logps import pair_rows, token_logps
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


def _trl_trainer(models, settings: dict) -> trl.DPOTrainer:
    reference_dir, policy_dir = models
    load = transformers.AutoModelForCausalLM.from_pretrained
    policy = load(policy_dir, dtype=torch.float32)
    args = trl.DPOConfig(output_dir=str(policy_dir.parent / "trl"), use_cpu=True, bf16=False,
                         gradient_checkpointing=False, report_to=[], **settings)
    dummy = {"prompt": ["t5"], "chosen": [" t6"], "rejected": [" t7"]}  # the batch is below
    return trl.DPOTrainer(model=policy, ref_model=load(reference_dir, dtype=torch.float32),
                          args=args, processing_class=word_level_tokenizer(VOCAB),
                          train_dataset=datasets.Dataset.from_dict(dummy))


def _trl_loss(trainer: trl.DPOTrainer, pairs: list[Pair]) -> torch.Tensor:
    batch = trainer.data_collator([{"prompt_ids": p.prompt.tolist(),
                                    "chosen_ids": p.chosen.tolist(),
                                    "rejected_ids": p.rejected.tolist()} for p in pairs])
    trainer.model.train()
    return trainer.compute_loss(trainer.model, batch)


def _trl_loss_and_grads(models, settings: dict) -> tuple[float, dict[str, np.ndarray]]:
    trainer = _trl_trainer(models, settings)
    loss = _trl_loss(trainer, PAIRS)
    loss.backward()
    grads = {name: param.grad.numpy() for name, param in trainer.model.named_parameters()}
    return float(loss.detach()), grads


def _with_reference(models, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows with the reference model's column, as a run caches it."""
    start = trainrun.load(models[0])
    cfg = start.config
    logps = jax.jit(lambda p, b: token_logps(bind_transformer(cfg)(p), pair_rows(b))[0])(
        start.params, rows)
    column = np.pad(np.asarray(logps), ((0, 0), (1, 0))).astype(np.float32).view(np.int32)
    return {**rows, REFERENCE_COLUMN: column}


def _trainrun_loss_and_grads(models, preference: PreferenceConfig,
                             ) -> tuple[float, dict[str, np.ndarray]]:
    policy = trainrun.load(models[1])
    cfg = policy.config
    rows, _ = pack_pairs(PAIRS, 32, bins=4)
    batch = _with_reference(models, rows)
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


def _ids(ids: np.ndarray) -> str:
    """Token ids as the word-level tokenizer's text."""
    return " ".join(f"t{i}" for i in ids.tolist())


@pytest.mark.slow
def test_pairs_with_no_preference_add_no_win_as_in_trl(models, tmp_path) -> None:
    """Pairs whose answers are the same tokens are exact ties in TRL (their two sequences
    compute the same: loss ln 2, no win); trainrun leaves them out of its rows (counted), so
    its loss and wins over the pairs it keeps are TRL's over the same records, ties apart."""
    from trainrun.config import RecordsData
    from trainrun.data.preference_rows import preference_rows

    # PAIRS with no id the tokenizer's special t2 and t0 begin (matched inside a word)
    pairs = [*PAIRS[:2], Pair(*(np.asarray(ids, np.uint32) for ids in (
        [11, 12, 13, 14], [70, 2], [71, 72, 73, 2]))), PAIRS[3]]
    tied = [Pair(p.prompt, p.chosen, p.chosen) for p in pairs] + [
        Pair(p.prompt, p.rejected, p.rejected) for p in pairs]
    records = [*pairs, *tied]
    trainer = _trl_trainer(models, dict(loss_type=["sigmoid"], beta=0.1))
    with torch.no_grad():
        trl_loss = float(_trl_loss(trainer, records))
    trl_accuracy = trainer._metrics["train"]["rewards/accuracies"][-1]

    word_level_tokenizer(VOCAB).save_pretrained(tmp_path / "tokenizer")
    source = tmp_path / "pairs.jsonl"  # the same pairs as records; the tokenizer ends each
    source.write_text("".join(json.dumps({  # answer with t2, its end
        "prompt": _ids(p.prompt), "chosen": " " + _ids(p.chosen[:-1]),
        "rejected": " " + _ids(p.rejected[:-1])}) + "\n" for p in records))
    data = RecordsData(paths=(str(source),), format="preference", seq_len=31,
                       tokenizer=str(tmp_path / "tokenizer"), eval_fraction=0.0,
                       bad_records="skip")
    kept, _, _ = preference_rows(data, 512, 0)
    assert kept.train is not None
    assert (kept.counts.examples, kept.counts.skipped) == (len(pairs), len(tied))
    policy = trainrun.load(models[1])
    model = make_preference_transformer(policy.config, PreferenceConfig(beta=0.1))
    batch = _with_reference(models, kept.train)
    loss, aux, _ = jax.jit(lambda p: model.loss(p, batch, jax.random.key(0)))(policy.params)
    assert float(aux["weight"]) == len(pairs)
    # TRL's mean over all the records: each tie's loss is ln 2 and adds no win
    assert (float(loss) * len(pairs) + len(tied) * np.log(2.0)) / len(records) == \
        pytest.approx(trl_loss, abs=1e-5)
    assert float(aux["rewards/accuracies"]) * len(pairs) == \
        pytest.approx(trl_accuracy * len(records))
    # the wins counted are no float noise: every kept pair's margin is far from a tie's
    margins = _margins(policy, batch)
    assert margins.size == len(pairs) and float(np.min(np.abs(margins))) > 1e-3


def _margins(policy, batch: dict[str, np.ndarray]) -> np.ndarray:
    """Each pair's ``(policy - reference)`` log-probability margin of chosen over rejected."""
    import jax.numpy as jnp

    scored = jax.jit(lambda p: token_logps(bind_transformer(policy.config)(p),
                                           pair_rows(batch))[0])
    mine, present = pair_logps(scored(policy.params), batch)
    column = jax.lax.bitcast_convert_type(jnp.asarray(batch[REFERENCE_COLUMN]), jnp.float32)
    reference, _ = pair_logps(column[:, 1:], batch)
    margins = (mine.chosen - reference.chosen) - (mine.rejected - reference.rejected)
    return np.asarray(margins)[np.asarray(present)]
