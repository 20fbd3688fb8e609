"""GPT-2 weights in and out of Hugging Face's layout: a random tiny GPT-2 made by `transformers`
(no download) loads into trainrun's transformer with the same logits, and trainrun's params
written back load in `transformers` with the same logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpt2_logits, save_tiny_gpt2

from trainrun.models import build_model
from trainrun.models.huggingface import (
    WeightsError,
    params_from_hf,
    read_model_dir,
    write_model_dir,
)
from trainrun.models.transformer import bind_transformer

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

TOKENS = np.random.default_rng(0).integers(0, 100, (2, 20))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), vocab=100)


def torch_logits(path) -> np.ndarray:
    return gpt2_logits(path, TOKENS)


def load(path):
    cfg, tensors = read_model_dir(path)
    template = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                            jax.eval_shape(build_model(cfg).init, jax.random.key(0)))
    return cfg, params_from_hf(tensors, cfg, template)


def our_logits(cfg, params) -> np.ndarray:
    return np.asarray(bind_transformer(cfg)(params)(jnp.asarray(TOKENS))[0])


@pytest.mark.slow
def test_a_gpt2_directory_loads_with_the_logits_transformers_computes(gpt2_dir):
    cfg, params = load(gpt2_dir)
    assert cfg.positions == "learned" and cfg.bias and cfg.layers == 2 and cfg.vocab == 100
    want = torch_logits(gpt2_dir)
    assert float(np.abs(want).max()) > 0.1
    np.testing.assert_allclose(our_logits(cfg, params), want, rtol=0, atol=1e-4)


def test_written_params_load_back_in_transformers_with_the_same_logits(gpt2_dir, tmp_path):
    cfg, params = load(gpt2_dir)
    # changed params, so a writer that copied the input directory would fail
    params = jax.tree.map(lambda x: x * 1.5, params)
    write_model_dir(params, cfg, tmp_path / "out")
    np.testing.assert_allclose(torch_logits(tmp_path / "out"), our_logits(cfg, params),
                               rtol=0, atol=1e-4)


def test_a_shape_or_name_mismatch_names_the_tensor(gpt2_dir):
    cfg, tensors = read_model_dir(gpt2_dir)
    template = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                            jax.eval_shape(build_model(cfg).init, jax.random.key(0)))
    bad = dict(tensors)
    bad["transformer.h.1.mlp.c_fc.weight"] = np.zeros((32, 64), np.float32)
    with pytest.raises(WeightsError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight has shape"):
        params_from_hf(bad, cfg, template)
    missing = {k: v for k, v in tensors.items() if k != "transformer.ln_f.bias"}
    with pytest.raises(WeightsError, match=r"transformer\.ln_f\.bias is missing"):
        params_from_hf(missing, cfg, template)
    extra = {**tensors, "transformer.h.7.attn.bias": np.zeros(3, np.float32)}
    with pytest.raises(WeightsError, match=r"'h\.7\.attn\.bias' has no place"):
        params_from_hf(extra, cfg, template)
