"""How the transformer's program is built (layers under ``lax.scan``, rematerialization) changes
the program, not the maths: the same loss and gradients, and the same params layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import llama_shaped
from flax import nnx

from trainrun.config import TransformerModel
from trainrun.models import build_model

BASE = TransformerModel(d_model=32, layers=3, heads=2, seq_len=24, vocab=64, dropout=0.1)
# Each setting alone and the usual combination; learned positions with the combination.
VARIANTS = [(True, "none", "rope"), (False, "full", "rope"), (True, "dots_saveable", "rope"),
            (True, "dots_with_no_batch_dims_saveable", "rope"), (True, "full", "learned"),
            (True, "full", "llama")]


TOKENS = np.random.default_rng(0).integers(0, 64, (4, 25)).astype(np.int32)


@functools.cache
def loss_and_grads(cfg: TransformerModel):
    """Loss and gradients at the params of ``cfg``'s unrolled form (init does not depend on how
    the program is built), on fixed tokens and a fixed dropout key."""
    model = build_model(cfg)
    params = build_model(cfg.model_copy(update={"scan_layers": False, "remat": "none"})).init(
        jax.random.key(0))
    return jax.jit(jax.value_and_grad(
        lambda p: model.loss(p, {"tokens": TOKENS}, jax.random.key(3))[0]))(params)


@pytest.mark.slow
@pytest.mark.parametrize(("scan", "remat", "positions"), VARIANTS)
def test_scan_and_remat_compute_the_unrolled_loss_and_gradients(scan, remat, positions):
    cfg = (llama_shaped(BASE, kv_heads=1) if positions == "llama"
           else BASE.model_copy(update={"positions": positions}))
    variant = cfg.model_copy(update={"scan_layers": scan, "remat": remat})
    # The params' layout does not depend on the program: one init, checkpoints interchangeable.
    assert (jax.tree.structure(jax.eval_shape(build_model(variant).init, jax.random.key(0)))
            == jax.tree.structure(jax.eval_shape(build_model(cfg).init, jax.random.key(0))))
    loss, grads = loss_and_grads(cfg)
    got, got_grads = loss_and_grads(variant)
    without_dropout, _ = loss_and_grads(cfg.model_copy(update={"dropout": 0.0}))
    assert abs(float(loss) - float(without_dropout)) > 1e-4  # dropout is on, keys must match
    assert abs(float(got) - float(loss)) <= 1e-6
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                              jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(g, ref, rtol=0, atol=1e-6 * max(1.0, float(np.abs(ref).max())),
                                   err_msg=str(path))


def step_fn(cfg: TransformerModel):
    model = build_model(cfg)
    params = jax.eval_shape(model.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((4, cfg.seq_len + 1), np.int32)
    fn = jax.value_and_grad(lambda p, t: model.loss(p, {"tokens": t}, jax.random.key(0))[0])
    return fn, params, tokens


def count_dots(cfg: TransformerModel) -> int:
    fn, params, tokens = step_fn(cfg)
    return str(jax.make_jaxpr(fn)(params, tokens)).count("dot_general[")


def temporaries(cfg: TransformerModel) -> int:
    fn, params, tokens = step_fn(cfg)
    return jax.jit(fn).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_scanned_layers_compile_one_block_whatever_the_depth():
    def dots(layers: int, scan: bool) -> int:
        return count_dots(BASE.model_copy(update={"layers": layers, "scan_layers": scan}))

    assert dots(2, False) < dots(6, False)  # the control: unrolled grows with depth
    assert dots(2, True) == dots(6, True)


@pytest.mark.slow
def test_remat_under_scanned_layers_lowers_the_steps_temporaries():
    big = BASE.model_copy(update={"d_model": 64, "layers": 4, "seq_len": 64, "dropout": 0.0,
                                  "scan_layers": True})
    temp = {remat: temporaries(big.model_copy(update={"remat": remat}))
            for remat in ("none", "dots_saveable", "full")}
    assert temp["full"] < temp["dots_saveable"] < 0.5 * temp["none"], temp


@pytest.mark.parametrize("changes", [
    {}, {"positions": "learned", "bias": True},
    {"kv_heads": 1, "head_dim": 6, "mlp_hidden": 20, "tie_embeddings": False},
    {"llama": True},
    {"bias": True, "mlp": "swiglu", "lora": {"rank": 3, "alpha": 2.0, "targets": ["all-linear"]}},
    {"lora": {"rank": 2, "alpha": 2.0, "targets": ["q", "down"]}, "scan_layers": True},
    {"mlp": "swiglu", "experts": 4, "expert_hidden": 12, "dense_layers": [1],
     "lora": {"rank": 2, "alpha": 2.0, "targets": ["all-linear"]}},
    {"mlp": "swiglu", "fused_projections": True, "kv_heads": 1,
     "lora": {"rank": 2, "alpha": 2.0, "targets": ["all-linear"]}},
    {"norm": "rmsnorm", "pre_norms": False, "post_norms": True, "qk_norm": True,
     "qk_norm_over": "projection", "kv_heads": 1},
])
def test_parameter_count_is_the_count_of_the_params_init_makes(changes):
    from trainrun.models.transformer import parameter_count

    cfg = (llama_shaped(BASE, kv_heads=1) if changes.get("llama")
           else TransformerModel.model_validate({**BASE.model_dump(), **changes}))
    abstract = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    assert parameter_count(cfg) == sum(x.size for x in jax.tree.leaves(abstract))


# ---- soft-capping and OLMo-2's norms: each option's maths against a transcription ----------


def reference_attention(q, k, v, *, scale, cap=None, window=None, start=0):
    """Causal attention of ``[batch, seq, heads, head_dim]`` queries at positions ``start ..``
    to ``[batch, keys, kv_heads, head_dim]`` keys and values in NumPy (float64): scaled logits,
    soft-capped to ``cap * tanh(logits / cap)``, masked, softmax, weighted values."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if cap is not None:
        logits = cap * np.tanh(logits / cap)
    rows = start + np.arange(q.shape[1])[:, None]
    keys = np.arange(k.shape[1])[None, :]
    visible = (keys <= rows) & (keys > rows - window if window else True)
    logits = np.where(visible, logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


def qkv(seed: int, seq: int = 70, heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(2, seq, h, head_dim)) * 2.0).astype(np.float32)
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_attention_logits_are_soft_capped_before_the_mask_on_every_path(backend,
                                                                         monkeypatch):
    """The blocked path (70 rows: two blocks), and on a GPU, whose dot_product_attention
    cannot soft-cap, the same plain path (its choice checked here on a CPU)."""
    from trainrun.models import transformer

    monkeypatch.setattr(transformer.jax, "default_backend", lambda: backend)
    q, k, v = qkv(0)
    k, v = (np.repeat(t, 2, axis=2) for t in (k, v))  # the causal path takes whole heads
    got = transformer.causal_attention(q, k, v, scale=0.5, window=9, softcap=1.5)
    want = reference_attention(q, k, v, scale=0.5, cap=1.5, window=9)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    uncapped = reference_attention(q, k, v, scale=0.5, window=9)
    assert np.abs(uncapped - want).max() > 0.1  # the cap changes the answer here


def test_cached_attention_soft_caps_with_grouped_heads():
    """Decoding's attention to a key/value cache: a chunk of 5 queries at slots 20.. of 30,
    with and without soft-capping, equal to ``dot_product_attention``'s without."""
    from trainrun.models.transformer import cached_attention

    q, _, _ = qkv(1, seq=5)
    _, k, v = qkv(2, seq=30)
    rows, keys = 20 + np.arange(5)[:, None], np.arange(30)[None, :]
    visible = (keys <= rows)[None]
    cached_k, cached_v = (t.transpose(0, 2, 1, 3) for t in (k, v))  # the cache is head-major
    got = cached_attention(q, cached_k, cached_v, visible, scale=0.4, softcap=2.0)
    want = reference_attention(q, k, v, scale=0.4, cap=2.0, start=20)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    plain = cached_attention(q, cached_k, cached_v, visible, scale=0.4)
    np.testing.assert_allclose(plain, reference_attention(q, k, v, scale=0.4, start=20),
                               rtol=0, atol=2e-5)
    dot_product = jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], scale=0.4)
    np.testing.assert_allclose(plain, dot_product, rtol=0, atol=2e-6)


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_head_loss_and_gradients_are_those_of_soft_capped_logits(chunk):
    """The chunked head's loss and its custom backward pass, against autodiff of the
    cross-entropy of ``cap * tanh(features @ table.T / cap)``."""
    import optax

    from trainrun.models.losses import next_token_from_features

    rng = np.random.default_rng(3)
    features = rng.normal(size=(20, 16)).astype(np.float32)
    table = rng.normal(size=(50, 16)).astype(np.float32)
    targets = rng.integers(0, 50, 20)

    def direct(f, t):
        logits = 3.0 * jnp.tanh(f @ t.T / 3.0)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def ours(f, t, cap):
        return next_token_from_features(f, t, targets, chunk, softcap=cap)[0]

    loss, grads = jax.value_and_grad(ours, argnums=(0, 1))(features, table, 3.0)
    want, want_grads = jax.value_and_grad(direct, argnums=(0, 1))(features, table)
    assert abs(float(loss) - float(want)) < 1e-5
    for got, ref in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    assert abs(float(ours(features, table, None)) - float(loss)) > 1.0


def capped_olmo(**changes) -> TransformerModel:
    """A tiny model with every new option: OLMo-2's norms and both soft-caps."""
    return llama_shaped(BASE, kv_heads=1).model_copy(update={
        "dropout": 0.0, "pre_norms": False, "post_norms": True, "qk_norm": True,
        "qk_norm_over": "projection", "attention_logit_softcap": 0.5,
        "final_logit_softcap": 1.5, "init_std": 0.5, **changes})


@pytest.mark.slow
def test_logits_are_soft_capped_in_training_eval_and_decoding():
    """The forward's logits are the uncapped model's, capped; the training loss is theirs; a
    prompt run through the key/value cache and one token decoded give the forward's logits."""
    import optax

    from trainrun.models.transformer import bind_transformer

    cfg = capped_olmo(layers=1)
    params = build_model(cfg).init(jax.random.key(0))
    tokens = TOKENS[:2]

    @jax.jit
    def run(params):
        module = bind_transformer(cfg)(params)
        uncapped = bind_transformer(cfg.model_copy(update={"final_logit_softcap": None}))(params)
        prefill, cache = module.last_logits(tokens[:, :11], module.empty_cache(2, 12), 0)
        step, _ = module.last_logits(tokens[:, 11:12], cache, 11)
        return (module(tokens[:, :-1])[0], uncapped(tokens[:, :-1])[0], prefill, step,
                build_model(cfg).loss(params, {"tokens": tokens}, None)[0])

    logits, raw, prefill, step, loss = run(params)
    assert float(np.abs(raw).max()) > 3.0  # the cap bites
    np.testing.assert_allclose(logits, 1.5 * np.tanh(np.asarray(raw, np.float64) / 1.5),
                               rtol=0, atol=1e-5)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    assert abs(float(loss) - float(want)) < 1e-5
    np.testing.assert_allclose(prefill, logits[:, 10], rtol=0, atol=1e-5)
    np.testing.assert_allclose(step, logits[:, 11], rtol=0, atol=1e-5)


def rms(x, axis=-1, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + eps)


def test_a_block_without_pre_norms_norms_each_sublayers_output_before_its_residual():
    """OLMo-2's block: ``h = x + post_attn(attn(x))``, then ``h + post_mlp(mlp(h))``, the
    attention's q and k each RMS-normed over the whole projection, all heads together."""
    from trainrun.models.transformer import Block

    cfg = capped_olmo(positions="learned", attention_logit_softcap=None)
    block = Block(cfg, nnx.Rngs(params=0))
    for norm in (block.attn_out_norm, block.mlp_out_norm, block.attn.q_norm, block.attn.k_norm):
        norm.scale[...] = jax.random.normal(jax.random.key(7), norm.scale.shape) + 1.0
    assert block.ln1 is None and block.ln2 is None
    x = np.random.default_rng(4).normal(size=(2, 9, cfg.d_model)).astype(np.float32)
    got = jax.jit(lambda x: block(x, None, None)[0])(x)  # one program, not an op at a time

    attn = block.attn
    w = {name: np.asarray(getattr(attn, name).kernel[...], np.float64) for name in "qkvo"}
    qs = rms(x @ w["q"]) * np.asarray(attn.q_norm.scale[...])  # [2, 9, heads * head_dim]
    ks = rms(x @ w["k"]) * np.asarray(attn.k_norm.scale[...])
    heads, head_dim = cfg.heads, cfg.attention_head_dim
    split = [t.reshape(2, 9, -1, head_dim) for t in (qs, ks, x @ w["v"])]
    y = reference_attention(*split, scale=head_dim ** -0.5).reshape(2, 9, heads * head_dim)
    h = x + rms(y @ w["o"]) * np.asarray(block.attn_out_norm.scale[...])
    mlp = block.mlp
    gate, up, down = (np.asarray(getattr(mlp, n).kernel[...], np.float64)
                      for n in ("gate", "up", "down"))
    inner = (h @ gate) / (1 + np.exp(-(h @ gate))) * (h @ up)
    want = h + rms(inner @ down) * np.asarray(block.mlp_out_norm.scale[...])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    per_head = block.attn.q_norm.scale.shape != (heads * head_dim,)
    assert not per_head
