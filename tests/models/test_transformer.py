"""How the transformer's program is built (layers under ``lax.scan``, rematerialization) changes
the program, not the maths: the same loss and gradients, and the same params layout."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import llama_shaped

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
])
def test_parameter_count_is_the_count_of_the_params_init_makes(changes):
    from trainrun.models.transformer import parameter_count

    cfg = (llama_shaped(BASE, kv_heads=1) if changes.get("llama")
           else TransformerModel.model_validate({**BASE.model_dump(), **changes}))
    abstract = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    assert parameter_count(cfg) == sum(x.size for x in jax.tree.leaves(abstract))
