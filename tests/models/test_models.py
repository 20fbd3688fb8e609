"""The built-in models: the transformer's maths (causality, cache, tied embeddings, dropout),
named axes for sharding, and each model learning what it is for."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import llama_shaped

from trainrun.config import CNNModel, NNXMLPModel, TransformerModel
from trainrun.data.digits import digits_arrays
from trainrun.models import bind_params, build_model
from trainrun.models.transformer import bind_transformer

TINY = dict(d_model=32, layers=2, heads=4, seq_len=16)


def tokens(batch: int = 2, length: int = 17, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.uint8)


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["rope", "learned", "llama"])
def test_attention_is_causal_and_the_cache_gives_the_same_logits(positions):
    cfg = (llama_shaped(TransformerModel(**TINY), kv_heads=2) if positions == "llama"
           else TransformerModel(**TINY, positions=positions))
    module_of = bind_transformer(cfg)
    params = build_model(cfg).init(jax.random.key(0))
    forward = jax.jit(lambda p, x: module_of(p)(x)[0])
    x = tokens()[:, :16]
    full = forward(params, x)
    changed = x.copy()
    changed[:, 10:] = 255 - changed[:, 10:]
    after = forward(params, changed)
    np.testing.assert_array_equal(full[:, :10], after[:, :10])  # the past never sees the future
    assert not np.allclose(full[:, 10:], after[:, 10:])

    @jax.jit
    def decode(p, x, cache, pos):
        return module_of(p)(x, cache=cache, pos=pos)

    cache = module_of(params).empty_cache(2, cfg.seq_len)
    chunk, cache = decode(params, x[:, :5], cache, 0)  # prefill, then one token at a time
    steps = [chunk]
    for t in range(5, 16):
        logits, cache = decode(params, x[:, t:t + 1], cache, t)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5)


@pytest.mark.slow
def test_embeddings_are_tied_and_every_param_names_its_axes():
    cfg = TransformerModel(**TINY, positions="learned")
    model = build_model(cfg)
    params = model.init(jax.random.key(0))
    assert params["embed"]["embedding"].shape == (256, 32)
    assert not any(leaf.shape[-1] == 256 and name != "embed" for name, leaf in
                   ((p[0].key, leaf) for p, leaf in jax.tree_util.tree_leaves_with_path(params)))
    axes = model.logical_axes
    is_axes = lambda x: isinstance(x, tuple)
    paired = jax.tree.map(lambda names, p: len(names) == p.ndim, axes, params, is_leaf=is_axes)
    assert all(jax.tree.leaves(paired))
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    block = axes["blocks"]["0"]
    assert block["attn"]["q"]["kernel"] == ("embed", "heads")
    assert block["attn"]["o"]["kernel"] == ("heads", "embed")
    assert block["mlp"]["up"]["kernel"] == ("embed", "mlp")
    assert block["mlp"]["down"]["kernel"] == ("mlp", "embed")

    # The output layer is the embedding: its gradient gets a share from the logits too.
    batch = {"tokens": tokens()}
    grads = jax.jit(jax.grad(lambda p: model.loss(p, batch, jax.random.key(1))[0]))(params)
    unused_rows = np.setdiff1d(np.arange(256), batch["tokens"][:, :-1])
    assert np.abs(grads["embed"]["embedding"][unused_rows]).sum() > 0


@pytest.mark.slow
def test_dropout_draws_from_the_step_key_and_eval_turns_it_off():
    cfg = TransformerModel(**TINY, dropout=0.2)
    model = build_model(cfg)
    params = model.init(jax.random.key(0))
    batch = {"tokens": tokens()}
    loss = jax.jit(model.loss)
    a, b, c = (loss(params, batch, jax.random.key(k))[0] for k in (1, 1, 2))
    assert a == b and a != c
    no_dropout = build_model(cfg.model_copy(update={"dropout": 0.0}))
    eval_loss, aux = jax.jit(model.eval_loss)(params, batch)
    assert eval_loss == jax.jit(no_dropout.loss)(params, batch, jax.random.key(3))[0]
    assert aux["bits_per_byte"] == pytest.approx(float(eval_loss) / math.log(2), rel=1e-6)
    assert abs(float(eval_loss) - math.log(256)) < 0.1  # an untrained model knows nothing


def fit(model, batches, steps: int, lr: float = 3e-3) -> list[float]:
    opt = optax.adam(lr)
    params = model.init(jax.random.key(0))
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch, key):
        (loss, _), grads = jax.value_and_grad(
            lambda p, b, k: model.loss(p, b, k)[:2], has_aux=True)(params, batch, key)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, batches(i), jax.random.key(i))
        losses.append(float(loss))
    return losses, params


@pytest.mark.slow
def test_transformer_learns_a_repeating_text():
    text = np.frombuffer(b"def add(a, b):\n    return a + b\n\n" * 8, np.uint8)
    cfg = TransformerModel(**TINY)
    windows = np.lib.stride_tricks.sliding_window_view(text, 17)[::5]
    losses, _ = fit(build_model(cfg), lambda i: {"tokens": windows[(i * 8) % 40:][:8]}, 120)
    assert losses[-1] < 0.5 < 5.0 < losses[0]  # from ln(256) = 5.5 to predicting the code


def digit_batches(size: int = 64):
    train = digits_arrays()["train"]
    return train, lambda i: jax.tree.map(lambda a: a[(i * size) % 1344:][:size], train)


@pytest.mark.slow
def test_cnn_learns_digits():
    train, batches = digit_batches()
    cnn = build_model(CNNModel(channels=[8, 16], hidden=32))
    evaluate = jax.jit(cnn.eval_loss)
    before, _ = evaluate(cnn.init(jax.random.key(0)), train)
    _, params = fit(cnn, batches, 100)
    after, aux = evaluate(params, train)
    assert after < 0.3 * before and aux["accuracy"] > 0.85


def test_nnx_mlp_classifies_digits():
    train, batches = digit_batches()
    mlp = build_model(NNXMLPModel(features=64, hidden=[32], outputs=10, task="classification"))
    _, params = fit(mlp, batches, 40)
    _, aux = jax.jit(mlp.eval_loss)(params, train)
    assert aux["accuracy"] > 0.8


def test_nnx_mlp_regression_fits_the_chapter_task():
    x = np.asarray(jax.random.normal(jax.random.key(1), (256, 8)))
    data = {"x": x, "y": x.sum(1, keepdims=True)}
    losses, _ = fit(build_model(NNXMLPModel(hidden=[32])), lambda i: data, 200, lr=1e-2)
    assert losses[-1] < losses[0] / 50


def test_a_model_and_its_decoder_trace_the_module_once(monkeypatch):
    from trainrun.models import transformer

    built: list[TransformerModel] = []
    init = transformer.Transformer.__init__

    def counted(self, cfg, *args, **kwargs):
        built.append(cfg)
        init(self, cfg, *args, **kwargs)

    monkeypatch.setattr(transformer.Transformer, "__init__", counted)
    cfg = TransformerModel(**TINY, init_std=0.0123457)  # a config no other test builds
    model = build_model(cfg)
    module_of = bind_transformer(cfg)
    assert len(built) == 1
    params = model.init(jax.random.key(0))
    assert len(built) == 2  # init builds the module with real params
    uncached = bind_params(lambda rngs: transformer.Transformer(cfg, rngs))
    assert len(built) == 3
    assert np.array_equal(module_of(params)(jnp.asarray(tokens()))[0],
                          uncached(params)(jnp.asarray(tokens()))[0])
    bind_transformer(TransformerModel(**TINY, init_std=0.0123458))  # another config: traced anew
    assert len(built) == 4
    # A longer context of rotary positions is the same module; of learned ones, a larger table.
    longer = bind_transformer(cfg.model_copy(update={"seq_len": 64}))
    assert len(built) == 4
    assert np.array_equal(longer(params)(jnp.asarray(tokens(length=40)))[0],
                          uncached(params)(jnp.asarray(tokens(length=40)))[0])
    learned = TransformerModel(**TINY, init_std=0.0123457, positions="learned")
    bind_transformer(learned)
    bind_transformer(learned.model_copy(update={"seq_len": 64}))
    assert len(built) == 6
