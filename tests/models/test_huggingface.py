"""Weights in and out of Hugging Face's layout, four families: tiny random models made by
`transformers` (no download) load with the logits `transformers` computes, trainrun's params
written back load in `transformers` with trainrun's logits, and whatever config.json asks that
trainrun does not compute is refused in one line."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import hf_logits, save_tiny_causal_lm, save_tiny_gpt2

import trainrun
from trainrun.checkpointing.init_from import model_of
from trainrun.models.huggingface import INDEX, Tensors, WeightsError, write_model_dir

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

TOKENS = np.random.default_rng(0).integers(0, 96, (2, 20))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        # sharded: several files and model.safetensors.index.json
        "llama": save_tiny_causal_lm(root / "llama", "llama", max_shard_size="40KB"),
        "qwen2": save_tiny_causal_lm(root / "qwen2", "qwen2"),
        "mistral": save_tiny_causal_lm(root / "mistral", "mistral"),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_llama_family_directory_loads_with_the_logits_transformers_computes(family_dirs,
                                                                              family):
    path = family_dirs[family]
    model = trainrun.load(path)
    cfg = model.config
    assert (cfg.norm, cfg.mlp, cfg.positions, cfg.layers) == ("rmsnorm", "swiglu", "rope", 2)
    if family == "llama":  # GQA, Llama 3's rotary base and scaling, an untied head, sharded
        assert (path / INDEX).is_file() and len(list(path.glob("model-*.safetensors"))) > 1
        assert cfg.kv_heads == 2 and cfg.rope_theta == 500000.0 and not cfg.tie_embeddings
        assert cfg.rope_scaling is not None and cfg.rope_scaling.type == "llama3"
    elif family == "qwen2":  # q/k/v biases, a tied head
        assert cfg.qkv_bias and cfg.tie_embeddings and "head" not in model.params
        assert float(np.abs(model.params["blocks"]["0"]["attn"]["k"]["bias"]).max()) > 0.1
    else:  # multi-query: one key/value head; a head_dim that is not d_model / heads
        assert cfg.kv_heads == 1 and cfg.head_dim == 24
    want = hf_logits(path, TOKENS)
    assert float(np.abs(want).max()) > 0.1
    np.testing.assert_allclose(model(TOKENS), want, rtol=0, atol=1e-4)


def test_the_llama3_rotary_scaling_is_computed_not_ignored(family_dirs, tmp_path):
    """Without the scaling the logits differ: the test above would catch an ignored field."""
    plain = save_tiny_causal_lm(tmp_path / "plain", "llama", rope_scaling=None)
    scaled = trainrun.load(family_dirs["llama"])
    assert not np.allclose(trainrun.load(plain)(TOKENS), scaled(TOKENS), atol=1e-3)


def test_bfloat16_and_float16_files_load_as_their_values(tmp_path):
    for dtype in ("bfloat16", "float16"):
        path = save_tiny_causal_lm(tmp_path / dtype, "llama", dtype=dtype)
        assert json.loads((path / "config.json").read_text())["dtype"] == dtype
        model = trainrun.load(path)
        np.testing.assert_allclose(model(TOKENS), hf_logits(path, TOKENS), rtol=0, atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_tied_or_untied_loads_with_transformers_logits(tmp_path, tied):
    path = save_tiny_gpt2(tmp_path / "gpt2", vocab=96, tie_word_embeddings=tied)
    model = trainrun.load(path)
    assert model.config.tie_embeddings is tied and ("head" in model.params) is not tied
    np.testing.assert_allclose(model(TOKENS), hf_logits(path, TOKENS), rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mistral"])
def test_written_params_load_back_in_transformers_with_the_same_logits(family_dirs, family,
                                                                       tmp_path):
    source = (save_tiny_gpt2(tmp_path / "gpt2", vocab=96) if family == "gpt2"
              else family_dirs[family])
    model = trainrun.load(source)
    # changed params, so a writer that copied the input directory would fail
    params = jax.tree.map(lambda x: np.asarray(x) * 1.5, model.params)
    hf = json.loads((source / "config.json").read_text())
    out = write_model_dir(params, model.config, tmp_path / "out", model_type=family,
                          source=hf, shard_bytes=30_000)
    assert (out / INDEX).is_file()  # above the shard size: shards and their index
    ours = trainrun.LanguageModel(model.config, params)(TOKENS)
    assert not np.allclose(ours, model(TOKENS), atol=1e-3)
    np.testing.assert_allclose(hf_logits(out, TOKENS), ours, rtol=0, atol=1e-4)
    np.testing.assert_allclose(trainrun.load(out)(TOKENS), ours, rtol=0, atol=1e-5)


def refusal(tmp_path, family: str, **changes) -> str:
    if family == "gpt2":
        path = save_tiny_gpt2(tmp_path / family, vocab=96, **changes)
    else:
        path = save_tiny_causal_lm(tmp_path / family, family, **changes)
    with pytest.raises(WeightsError) as err:
        model_of(path, seq_len=64)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_what_config_json_asks_and_trainrun_does_not_compute_is_refused(tmp_path):
    assert "scale_attn_weights" in refusal(tmp_path / "a", "gpt2", scale_attn_weights=False)
    assert "sliding_window 16" in refusal(tmp_path / "b", "mistral", sliding_window=16)
    assert "'yarn'" in refusal(tmp_path / "c", "llama", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert "hidden_act" in refusal(tmp_path / "d", "llama", hidden_act="gelu")
    assert "attention_bias" in refusal(tmp_path / "e", "llama", attention_bias=True)
    assert "partial_rotary_factor" in refusal(tmp_path / "g", "llama", partial_rotary_factor=0.5)
    path = save_tiny_causal_lm(tmp_path / "f", "qwen2")
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "model_type": "bert"}))
    with pytest.raises(WeightsError, match="model_type 'bert'"):
        model_of(path)


def test_a_truncated_or_mismatched_file_is_one_line_naming_it(family_dirs, tmp_path):
    path = save_tiny_causal_lm(tmp_path / "cut", "qwen2")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors") as err:
        trainrun.load(path)
    assert "\n" not in str(err.value)
    # a shard the index names that is not there
    sharded = family_dirs["llama"]
    copy = tmp_path / "llama"
    copy.mkdir()
    for file in sharded.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    first = sorted(copy.glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(WeightsError, match="incomplete"):
        Tensors.of(copy)
    # a tensor whose shape does not fit the config names the tensor
    changed = tmp_path / "wide"
    changed.mkdir()
    for file in path.iterdir():
        (changed / file.name).write_bytes(file.read_bytes())
    save_tiny_causal_lm(changed, "qwen2")
    hf = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**hf, "intermediate_size": 64}))
    with pytest.raises(WeightsError, match=r"mlp\.gate_proj\.weight has shape \(96, 64\)"):
        trainrun.load(changed)
