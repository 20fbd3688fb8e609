"""Weights in and out of Hugging Face's layout, four families: tiny random models made by
`transformers` (no download) load with the logits `transformers` computes, trainrun's params
written back load in `transformers` with trainrun's logits, and whatever config.json asks that
trainrun does not compute is refused in one line."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from conftest import hf_logits, save_tiny_causal_lm, save_tiny_gpt2

import trainrun
from trainrun.checkpointing.init_from import model_of
from trainrun.config import TransformerModel
from trainrun.models.huggingface import (
    INDEX,
    ROPE_KEYS,
    Tensors,
    WeightsError,
    architecture,
    config_json,
    write_model_dir,
)
from trainrun.platform.host_memory import HostMemory

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
    assert "attention_bias" in refusal(tmp_path / "b", "mistral", attention_bias=True)
    assert "'yarn'" in refusal(tmp_path / "c", "llama", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert "hidden_act" in refusal(tmp_path / "d", "llama", hidden_act="gelu")
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


@pytest.mark.parametrize("name", ["config.json", INDEX, "model-00003-of-00012.safetensors"])
def test_a_file_linking_out_of_the_model_directory_is_refused(family_dirs, tmp_path, name):
    """Before, a config.json, index or shard linking elsewhere was read as the model's own."""
    sharded = family_dirs["llama"]
    assert (sharded / name).is_file()
    copy = tmp_path / "llama"
    copy.mkdir()
    for file in sharded.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    elsewhere = tmp_path / "elsewhere"
    (copy / name).rename(elsewhere)
    (copy / name).symlink_to(elsewhere)
    with pytest.raises(WeightsError) as refused:
        trainrun.load(copy)
    assert str(refused.value).startswith(
        f"{copy}/{name} is a symbolic link to {elsewhere}, outside {copy}: ")
    assert "\n" not in str(refused.value)


def test_a_hub_snapshots_links_into_its_blobs_load(family_dirs, tmp_path):
    """snapshots/<revision>/<file> -> ../../blobs/<hash>, as the hub cache lays a model out."""
    sharded = family_dirs["llama"]
    repo = tmp_path / "models--me--llama"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sharded.iterdir():
        (repo / "blobs" / f"blob-{file.name}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(f"../../blobs/blob-{file.name}")
    loaded, own = Tensors.of(snapshot), Tensors.of(sharded)
    assert loaded.names == own.names
    for name in sorted(own.names):
        np.testing.assert_array_equal(loaded.read(name), own.read(name))


def test_config_json_keeps_the_source_but_what_the_run_changed(family_dirs):
    """The source's fields stay as written; a changed rotary base and a longer context are
    written, and read back as the model trained."""
    path = family_dirs["llama"]
    source = {**json.loads((path / "config.json").read_text()), "initializer_range": 0.1,
              "lab_notes": {"kept": [1, 2.5]}}
    cfg = trainrun.load(path).config
    assert config_json(cfg, "llama", source) == source
    changed = cfg.model_copy(update={"rope_theta": 10000.0, "seq_len": 1024})
    out = config_json(changed, "llama", source)
    assert {k: v for k, v in out.items() if k not in ROPE_KEYS} == {
        **{k: v for k, v in source.items() if k not in ROPE_KEYS},
        "max_position_embeddings": 1024}
    assert architecture(out).fields == {**architecture(source).fields, "rope_theta": 10000.0}


# ---- every value of config.json checked before use ------------------------------------------


def edited_copy(source, to, **changes):
    """A copy of the model directory ``source`` at ``to`` with ``changes`` in its config.json
    (a value None: the key removed)."""
    to.mkdir()
    for file in source.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    hf = json.loads((to / "config.json").read_text())
    hf.update(changes)
    (to / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return to


@pytest.mark.parametrize(("family", "changes", "says"), [
    # each was a traceback (AttributeError, ValueError, ZeroDivisionError or pydantic's)
    ("llama", {"rope_parameters": [1, 2]}, r"rope_parameters \[1, 2\], which is not an object"),
    ("llama", {"partial_rotary_factor": "abc"}, "partial_rotary_factor 'abc', which is not"),
    ("llama", {"num_attention_heads": 0}, "num_attention_heads 0, which is not a whole number"),
    ("llama", {"hidden_size": -32}, "hidden_size -32, which is not a whole number from 1"),
    ("mistral", {"sliding_window": "abc"}, "sliding_window 'abc', which is not a whole number"),
    ("qwen2", {"sliding_window": "abc", "use_sliding_window": True}, "sliding_window 'abc'"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": "x"}},
     "rope_parameters.factor 'x', which is not a finite number above 0"),
    ("llama", {"layer_types": ["full_attention", 3]}, r"layer_types\[1\] 3, which is not"),
    ("llama", {"rms_norm_eps": float("nan")}, "rms_norm_eps nan, which is not a finite number"),
    # accepted before and converted: a damaged file, not a value to guess at
    ("llama", {"intermediate_size": "96"}, "intermediate_size '96', which is not a whole"),
    ("qwen2", {"tie_word_embeddings": "false"}, "tie_word_embeddings 'false', which is not "
                                                "true or false"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of "
                                          "num_key_value_heads 3"),
    ("gpt2", {"n_head": 3}, "n_embd 32 is not a multiple of n_head 3"),
    ("gpt2", {"n_layer": 2.0}, "n_layer 2.0, which is not a whole number"),
    ("llama", {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "decoder_sparse_step": 0},
     "decoder_sparse_step 0, which is not a whole number from 1 to 2\\*\\*63 - 1"),
])
def test_each_config_json_value_is_checked_before_use(family_dirs, tmp_path, family, changes,
                                                      says):
    source = (save_tiny_gpt2(tmp_path / "gpt2", vocab=96) if family == "gpt2"
              else family_dirs[family])
    path = edited_copy(source, tmp_path / "edited", **changes)
    with pytest.raises(trainrun.UserError) as err:
        trainrun.load(path)
    message = str(err.value)
    assert "\n" not in message and str(path / "config.json") in message, message
    assert re.search(says, message), message


def test_a_model_larger_than_memory_is_refused_before_a_layer_is_built(family_dirs, tmp_path,
                                                                      monkeypatch):
    import trainrun.models
    from trainrun.training import preflight

    built = []
    build = trainrun.models.build_model

    def recorded(cfg):  # building 10**12 blocks ran for hours with no output
        built.append(cfg)
        assert cfg.layers < 1000, f"a model of {cfg.layers} layers is being built"
        return build(cfg)

    monkeypatch.setattr(trainrun.models, "build_model", recorded)
    huge = edited_copy(family_dirs["llama"], tmp_path / "huge", num_hidden_layers=10**12)
    with pytest.raises(trainrun.UserError, match=r"layers=1000000000000.* has "
                       r"30,848,000,000,012,352 params, .* as float32 alone, and .* of host "
                       r"memory is free") as err:
        trainrun.load(huge)
    assert "\n" not in str(err.value) and built == []
    # the check weighs params against the memory there is, not against a fixed limit
    model = trainrun.load(family_dirs["llama"])
    params = sum(np.size(x) for x in jax.tree.leaves(model.params))
    monkeypatch.setattr(preflight, "host_memory_free",
                        lambda: HostMemory(4 * params - 1, "(MemAvailable)", False))
    with pytest.raises(trainrun.UserError, match=f"has {params:,} params"):
        trainrun.load(family_dirs["llama"])
    monkeypatch.setattr(preflight, "host_memory_free",
                        lambda: HostMemory(4 * params, "(MemAvailable)", False))
    assert trainrun.load(family_dirs["llama"]).config.layers == 2


# ---- weights ------------------------------------------------------------------------------


def rewritten(path, to, **tensors):
    """A copy of the one-file model directory ``path`` at ``to`` whose model.safetensors has
    ``tensors`` in place of (or beside) its own."""
    from safetensors.numpy import load_file, save_file

    to.mkdir()
    for file in path.iterdir():
        (to / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(to / "model.safetensors"))
    save_file({**weights, **tensors}, str(to / "model.safetensors"), metadata={"format": "pt"})
    return to


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_tied_config_whose_file_holds_another_head_loads_untied_as_transformers_does(
        family_dirs, tmp_path, family):
    """transformers ties lm_head to the embedding only when the file's two are equal
    (PreTrainedModel.tie_weights); trainrun tied them and its logits differed by ~1."""
    source = (save_tiny_gpt2(tmp_path / "gpt2", vocab=96, tie_word_embeddings=False)
              if family == "gpt2" else family_dirs["llama"])
    path = edited_copy(source, tmp_path / "tied", tie_word_embeddings=True)
    model = trainrun.load(path)
    np.testing.assert_allclose(model(TOKENS), hf_logits(path, TOKENS), rtol=0, atol=1e-4)
    assert not model.config.tie_embeddings and "head" in model.params


def test_a_tied_config_whose_file_holds_a_copy_of_the_embedding_stays_tied(family_dirs,
                                                                          tmp_path):
    from safetensors.numpy import load_file

    source = family_dirs["qwen2"]  # tied: transformers saved no lm_head.weight
    embedding = load_file(str(source / "model.safetensors"))["model.embed_tokens.weight"]
    path = rewritten(source, tmp_path / "copy", **{"lm_head.weight": embedding.copy()})
    model = trainrun.load(path)
    assert model.config.tie_embeddings and "head" not in model.params
    np.testing.assert_allclose(model(TOKENS), hf_logits(path, TOKENS), rtol=0, atol=1e-4)
    # the run's model section may not tie what the file unties
    other = rewritten(source, tmp_path / "other", **{"lm_head.weight": embedding * 2})
    with pytest.raises(WeightsError, match=r"lm_head\.weight that differs from the embedding"):
        model_of(other, TransformerModel(tie_embeddings=True))


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.bool_])
def test_integer_and_bool_weights_are_refused_naming_the_tensor_its_dtype_and_file(
        family_dirs, tmp_path, dtype):
    from safetensors.numpy import load_file

    source = family_dirs["qwen2"]
    name = "model.layers.1.mlp.up_proj.weight"
    weight = load_file(str(source / "model.safetensors"))[name]
    path = rewritten(source, tmp_path / "ints", **{name: (weight * 10).astype(dtype)})
    with pytest.raises(WeightsError) as err:
        trainrun.load(path)  # was: loaded, and trained, as floats
    kind = {np.int64: "I64", np.int8: "I8", np.bool_: "BOOL"}[dtype]
    assert str(err.value) == (f"tensor {name} in {path / 'model.safetensors'} has dtype {kind}; "
                              "trainrun reads float weights (F16, BF16, F32, F64): give the "
                              "model's float weights")
