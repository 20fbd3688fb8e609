"""The language model on packed rows: no attention across documents on the CPU path and on the
XLA path the other backends take (the gradient of one document's loss with respect to another
document's token embeddings in the same row is exactly zero; without segment ids it is not),
padding changes nothing, a packed row computes what its documents compute alone, eval's bits
per byte is the held-out nats / ln 2 / bytes, and a tokenized, packed run resumes bitwise and
samples text through its tokenizer."""

from __future__ import annotations

import io
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun import rundir
from trainrun.config import TransformerModel, load_config
from trainrun.data import ArrayBatches
from trainrun.data.documents import pack_documents
from trainrun.evaluation.sample import sample_run
from trainrun.models import build_model
from trainrun.models import transformer as tf
from trainrun.models.losses import next_token_from_features
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.evaluation import Evaluator
from trainrun.training.loop import run

SEQ = 24
CFG = TransformerModel(vocab=64, d_model=32, layers=2, heads=2, seq_len=SEQ, init_std=0.1)


def row_of_two_documents():
    """One row: document B (positions 0..9), then document A (0..13), as packing lays them."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CFG.vocab, (1, SEQ)).astype(np.int32)
    segments = np.array([[1] * 10 + [2] * 14])
    positions = np.array([[*range(10), *range(14)]])
    return tokens, segments, positions


def document_a_loss_of_embeddings(cfg: TransformerModel, segments: np.ndarray | None):
    """``x -> loss of document A's targets`` where ``x`` is the row's token embeddings: the
    path from the embeddings through every block to the loss, with or without segment ids."""
    tokens, seg, positions = row_of_two_documents()
    model = build_model(cfg)
    module = tf.bind_transformer(cfg)(model.init(jax.random.key(1)))
    table = module.embed.embedding[...]
    angles = tf.Rope.at(jnp.arange(SEQ), tf.rotary_frequencies(module.head_dim))
    rope = tf.Rope(*(jnp.take(t, jnp.asarray(positions), axis=0) for t in angles))
    targets = jnp.asarray(np.roll(tokens, -1, axis=1)).reshape(-1)
    in_a = jnp.asarray((seg == 2) & (np.roll(seg, -1, axis=1) == 2)).reshape(-1)
    in_a = in_a.at[-1].set(False)  # the row's last token has no target

    def loss(x):
        blocks, _ = module._blocks(x, [rope] * cfg.layers, None, segments)
        features = module.ln_f(blocks).reshape(SEQ, -1)
        return next_token_from_features(features, table, targets, weights=in_a)[0]

    return loss, jnp.take(table, jnp.asarray(tokens), axis=0), seg


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "gpu"])  # gpu: the XLA form with a mask, in float32
@pytest.mark.parametrize("scan", [False, True])
def test_no_gradient_flows_between_documents_of_a_row(backend, scan, monkeypatch):
    monkeypatch.setattr(tf.jax, "default_backend", lambda: backend)
    cfg = CFG.model_copy(update={"scan_layers": scan, "remat": "full" if scan else "none"})
    segments = jnp.asarray(row_of_two_documents()[1])
    loss, x, seg = document_a_loss_of_embeddings(cfg, segments)
    grad = jax.grad(loss)(x)[0]
    b_rows, a_rows = grad[seg[0] == 1], grad[seg[0] == 2]
    assert np.all(np.asarray(b_rows) == 0.0)  # exactly: no path from B to A's loss
    assert np.abs(np.asarray(a_rows)).max() > 1e-4
    plain, x, _ = document_a_loss_of_embeddings(cfg, None)  # the control: no segment ids
    assert np.abs(np.asarray(jax.grad(plain)(x)[0][seg[0] == 1])).min() > 0.0


@pytest.mark.slow
def test_the_attention_mask_holds_on_the_half_precision_gpu_path(monkeypatch):
    """On a GPU in bfloat16 the mask goes to cuDNN; where cuDNN is not there (here), to XLA:
    the outputs of one segment never depend on the other's keys and values."""
    monkeypatch.setattr(tf.jax, "default_backend", lambda: "gpu")
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 2, 16), jnp.bfloat16)
               for i in range(3))
    segments = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])

    def out_of_second(k, v):
        return tf.causal_attention(q, k, v, segments)[0, 3:7].astype(jnp.float32).sum()

    dk, dv = jax.grad(out_of_second, argnums=(0, 1))(k, v)
    assert not np.asarray(dk[0, :3]).any() and not np.asarray(dv[0, :3]).any()
    assert np.asarray(dv[0, 3:7]).any()


def packed_batch(documents: list[np.ndarray], row_len: int) -> dict[str, np.ndarray]:
    rows = pack_documents(documents, row_len, bins=8)
    rows["token_bytes"] = np.where(rows["segment_ids"] > 0, 2, 0).astype(np.uint16)
    return rows


@pytest.mark.slow
def test_padding_changes_nothing_and_a_packed_row_is_its_documents_alone():
    model = build_model(CFG)
    params = model.init(jax.random.key(2))
    rng = np.random.default_rng(3)
    docs = [np.array([0, *rng.integers(1, 64, n)], np.uint16) for n in (9, 6, 5)]
    together = packed_batch(docs, SEQ + 1)  # all three in one row, padded at its end
    assert len(together["tokens"]) == 1 and (together["segment_ids"] == 0).any()
    value_and_grad = jax.jit(jax.value_and_grad(
        lambda p, b: model.loss(p, b, jax.random.key(0))[:2], has_aux=True))
    (loss, aux), grads = value_and_grad(params, together)
    assert aux["weight"] == 9 + 6 + 5  # the targets counted: each document's tokens

    scrambled = {k: v.copy() for k, v in together.items()}
    pad = scrambled["segment_ids"] == 0
    scrambled["tokens"][pad] = rng.integers(1, 64, pad.sum())
    scrambled["positions"][pad] = rng.integers(0, SEQ, pad.sum())
    (loss2, _), grads2 = value_and_grad(params, scrambled)
    assert loss2 == loss  # bitwise: a padded position changes nothing
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads),
                                                    jax.tree.leaves(grads2), strict=True))

    total = 0.0  # each document alone in its own row: the same summed loss
    for doc in docs:
        (alone, alone_aux), _ = value_and_grad(params, packed_batch([doc], SEQ + 1))
        total += float(alone) * float(alone_aux["weight"])
    assert math.isclose(float(loss) * 20, total, rel_tol=1e-5)
    assert math.isclose(float(aux["bits_per_byte"]), float(loss) / math.log(2) / 2,
                        rel_tol=1e-6)  # 2 bytes a token here


@pytest.mark.slow
def test_one_document_filling_the_row_computes_the_unpacked_loss():
    model = build_model(CFG)
    params = model.init(jax.random.key(4))
    tokens = np.random.default_rng(5).integers(0, 64, (3, SEQ + 1)).astype(np.uint16)
    plain, _, _ = model.loss(params, {"tokens": tokens}, jax.random.key(0))
    packed = {"tokens": tokens, "segment_ids": np.ones_like(tokens),
              "positions": np.broadcast_to(np.arange(SEQ + 1), tokens.shape)}
    loss, aux, _ = model.loss(params, packed, jax.random.key(0))
    assert aux["weight"] == 3 * SEQ
    np.testing.assert_allclose(loss, plain, rtol=1e-6)


@pytest.mark.slow
def test_eval_bits_per_byte_is_held_out_nats_over_their_bytes():
    model = build_model(CFG)
    params = model.init(jax.random.key(6))
    rng = np.random.default_rng(7)
    docs = [np.array([0, *rng.integers(1, 64, n)], np.uint16) for n in rng.integers(3, 60, 12)]
    rows = pack_documents(docs, SEQ + 1, bins=8)
    rows["token_bytes"] = np.where(rows["segment_ids"] > 0,
                                   rng.integers(1, 5, rows["tokens"].shape), 0).astype(np.uint16)
    data = ArrayBatches(rows, 2, shuffle=False, seed=0, split="eval")
    results = Evaluator(model, data, every=1)(params)
    nats = covered = tokens = 0.0
    for i in range(data.batches_per_epoch):
        loss, aux = model.eval_loss(params, data[i])
        nats += float(loss) * float(aux["weight"])
        tokens += float(aux["weight"])
        covered += float(aux["weight/bits_per_byte"])
    assert math.isclose(results["bits_per_byte"], nats / math.log(2) / covered, rel_tol=1e-5)
    assert math.isclose(results["loss"], nats / tokens, rel_tol=1e-5)
    assert "weight/bits_per_byte" not in results


CORPUS = {"a.py": "def add(a, b):\n    return a + b\n" * 30,
          "b.py": "import os\nprint(os.getcwd(), 'café')\n" * 40,
          "c.py": "class A:\n    x = 1\n" * 25}


@pytest.mark.slow
def test_a_packed_tokenized_run_resumes_bitwise(tmp_path):
    """Stopped at step 6 and resumed to 12, a shuffled packed run gives every step's loss and
    the data position of the run that went straight through. (``trainrun verify-resume
    --config lm_bpe`` proves the same with killed processes; BENCHMARKS.md.)"""
    for name, text in CORPUS.items():
        (tmp_path / name).write_text(text)
    small = [f"data.paths=[{tmp_path}/*.py]", f"data.tokenizer={tmp_path}/tok.json",
             "data.vocab_size=300", "model.vocab=300", "data.seq_len=16", "model.seq_len=16",
             "model.d_model=16", "model.layers=1", "data.batch_size=4", "eval.every=0",
             "steps_per_call=3", "metrics.every=3", "metrics.tensorboard=false",
             "checkpoint.every=6", "checkpoint.async=false",
             "optimizer.schedule.warmup=2", "optimizer.schedule.total_steps=12"]

    def train(run_dir, steps):
        run(load_config("lm_bpe", [*small, f"steps={steps}"]), run_dir, out=io.StringIO())
        return [r["loss"] for r in read_metrics(run_dir / rundir.METRICS)]

    whole = train(tmp_path / "whole", 12)
    train(tmp_path / "split", 6)
    split = train(tmp_path / "split", 12)
    assert np.array(split, np.float32).tobytes() == np.array(whole, np.float32).tobytes()
    for name in ("whole", "split"):
        position = tmp_path / name / "checkpoints" / "12" / "data" / "process_0-of-1.json"
        assert json.loads(position.read_text()) == {"next_index": 12}
    # Sampling goes through the run's tokenizer: the prompt opens a document, text comes out.
    text = sample_run(tmp_path / "whole", "def add", 6, temperature=0)
    assert text.startswith("def add") and len(text) > len("def add")
