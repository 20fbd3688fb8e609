"""LoRA adapters in and out of PEFT's adapter directory: trainrun's adapters written out load in
``peft`` onto a tiny random ``transformers`` model and change its weights and logits by exactly
``(alpha / rank) a b``; adapters ``peft`` saved read back into trainrun's ``a`` and ``b`` with the
same delta; what trainrun's adapters cannot express is refused on one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainrun.config import LoraConfig, TransformerModel
from trainrun.errors import UserError
from trainrun.models.huggingface import WeightsError
from trainrun.models.peft import (
    ADAPTER_BIN,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_files,
    base_model_name,
    read_adapter_dir,
    write_adapter_dir,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers",
                                   reason="the tests' extra holds transformers")
peft = pytest.importorskip("peft")

ALL = ("q", "k", "v", "o", "gate", "up", "down")
RANK, ALPHA = 4, 8.0
LAYERS, D, HEADS, KV_HEADS, HIDDEN, VOCAB = 2, 32, 4, 2, 48, 64
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
HF_NAME = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
GPT2_NAME = {"o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}


def hf_model(model_type: str) -> Any:
    """A tiny random causal LM of ``model_type``, the same weights each call."""
    if model_type == "gpt2":
        config: Any = transformers.GPT2Config(n_layer=LAYERS, n_embd=D, n_head=HEADS,
                                              vocab_size=VOCAB, n_positions=32,
                                              bos_token_id=0, eos_token_id=0)
        cls: Any = transformers.GPT2LMHeadModel
    else:
        config_cls, cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
        config = config_cls(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, intermediate_size=HIDDEN,
                            vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                            eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return cls(config).eval()


def trainrun_cfg(model_type: str, targets: tuple[str, ...] | None = None) -> TransformerModel:
    if targets is None:  # every linear layer the model has
        targets = tuple(t for t in ALL if model_type != "gpt2" or t != "gate")
    lora = LoraConfig(rank=RANK, alpha=ALPHA, targets=targets)  # type: ignore[arg-type]
    if model_type == "gpt2":
        return TransformerModel(vocab=VOCAB, d_model=D, layers=LAYERS, heads=HEADS, seq_len=32,
                                positions="learned", bias=True, lora=lora)
    return TransformerModel(vocab=VOCAB, d_model=D, layers=LAYERS, heads=HEADS,
                            kv_heads=KV_HEADS, mlp="swiglu", mlp_hidden=HIDDEN, norm="rmsnorm",
                            tie_embeddings=False, qkv_bias=model_type == "qwen2", lora=lora)


def dims(model_type: str, target: str) -> tuple[int, int]:
    kv = KV_HEADS * D // HEADS if model_type != "gpt2" else D
    hidden = 4 * D if model_type == "gpt2" else HIDDEN
    return {"q": (D, D), "k": (D, kv), "v": (D, kv), "o": (D, D), "gate": (D, hidden),
            "up": (D, hidden), "down": (hidden, D)}[target]


def random_adapters(model_type: str, targets: tuple[str, ...], seed: int = 1) -> dict:
    """trainrun-shaped adapter params with nonzero a and b."""
    rng = np.random.default_rng(seed)
    blocks: dict[str, Any] = {}
    for i in range(LAYERS):
        block: dict[str, Any] = {"attn": {}, "mlp": {}}
        for t in targets:
            d_in, d_out = dims(model_type, t)
            block["attn" if t in "qkvo" else "mlp"][f"{t}_lora"] = {
                "a": rng.normal(0, 0.3, (d_in, RANK)).astype(np.float32),
                "b": rng.normal(0, 0.3, (RANK, d_out)).astype(np.float32)}
        blocks[str(i)] = block
    return {"blocks": blocks}


def adapter(params: dict, i: int, t: str) -> tuple[np.ndarray, np.ndarray]:
    layer = params["blocks"][str(i)]["attn" if t in "qkvo" else "mlp"][f"{t}_lora"]
    return layer["a"], layer["b"]


def expected_deltas(model_type: str, params: dict, targets: tuple[str, ...]
                    ) -> dict[str, np.ndarray]:
    """HF module name -> the change to its weight, in the module's own weight layout."""
    scale = ALPHA / RANK
    out: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        for t in targets:
            if model_type != "gpt2":
                a, b = adapter(params, i, t)
                out[f"model.layers.{i}.{HF_NAME[t]}"] = scale * (a @ b).T  # Linear: [out, in]
            elif t in GPT2_NAME:
                a, b = adapter(params, i, t)
                out[f"transformer.h.{i}.{GPT2_NAME[t]}"] = scale * a @ b  # Conv1D: [in, out]
        if model_type == "gpt2" and set(targets) & set("qkv"):
            out[f"transformer.h.{i}.attn.c_attn"] = np.concatenate(
                [scale * np.matmul(*adapter(params, i, t)) if t in targets
                 else np.zeros((D, D), np.float32) for t in "qkv"], axis=1)
    return out


def peft_deltas(model: Any) -> dict[str, np.ndarray]:
    """HF module name -> PEFT's delta weight of its default adapter."""
    out = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            out[name] = module.get_delta_weight("default").detach().numpy()
    return out


def merged_logits(model_type: str, deltas: dict[str, np.ndarray]) -> np.ndarray:
    """The base model's logits with each adapted weight W replaced by W + delta."""
    model = hf_model(model_type)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, delta in deltas.items():
            modules[name].weight += torch.from_numpy(delta)
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS)).logits.numpy()


def save_peft(path: Path, model_type: str, **lora: Any) -> Path:
    """An adapter made and saved by ``peft`` (random nonzero A and B)."""
    lora = {"r": RANK, "lora_alpha": ALPHA, "init_lora_weights": False, **lora}
    if model_type == "gpt2":
        lora.setdefault("fan_in_fan_out", True)
    torch.manual_seed(1)
    model = peft.get_peft_model(hf_model(model_type), peft.LoraConfig(**lora))
    model.save_pretrained(path)
    return path


# ---- trainrun -> PEFT --------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_written_adapters_load_in_peft_with_their_delta(tmp_path, model_type):
    cfg = trainrun_cfg(model_type)
    params = random_adapters(model_type, ALL)
    write_adapter_dir(params, cfg, model_type, "tiny/base", tmp_path)
    assert base_model_name(tmp_path) == "tiny/base"
    model = peft.PeftModel.from_pretrained(hf_model(model_type), tmp_path).eval()

    want = expected_deltas(model_type, params, ALL)
    got = peft_deltas(model)
    assert sorted(got) == sorted(want) and len(want) == 7 * LAYERS
    for name, delta in want.items():
        np.testing.assert_allclose(got[name], delta, atol=1e-6, err_msg=name)
    peft_logits = logits(model)
    np.testing.assert_allclose(peft_logits, merged_logits(model_type, want), atol=1e-5)
    assert not np.allclose(peft_logits, logits(hf_model(model_type)), atol=1e-3)


def test_adapter_files_config_and_tensor_names():
    cfg = trainrun_cfg("llama", ("q", "v"))
    tensors, config = adapter_files(random_adapters("llama", ("q", "v")), cfg, "llama", "b")
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"]) == (RANK, 8)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "b" and config["inference_mode"] is True
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].shape == (
        RANK, D)
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (
        KV_HEADS * D // HEADS, RANK)
    assert len(tensors) == 2 * 2 * LAYERS
    assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in tensors.values())
    # peft itself accepts the config as written
    peft.LoraConfig(**{k: v for k, v in config.items() if k != "peft_type"})


# ---- PEFT -> trainrun --------------------------------------------------------------------------


@pytest.mark.parametrize(("model_type", "extra"), [
    ("llama", {}),
    ("llama", {"use_rslora": True}),
    ("llama", {"alpha_pattern": {"v_proj": 32}}),  # one scale: v's b is scaled to match
    ("qwen2", {}),
    ("mistral", {}),
])
def test_peft_adapters_read_back_with_their_delta(tmp_path, model_type, extra):
    modules = [HF_NAME[t].rsplit(".", 1)[1] for t in ALL]
    save_peft(tmp_path, model_type, target_modules=modules, **extra)
    settings, params = read_adapter_dir(tmp_path, trainrun_cfg(model_type), model_type)
    assert settings.rank == RANK and settings.targets == ALL
    assert settings.config().targets == ALL
    model = peft.PeftModel.from_pretrained(hf_model(model_type), tmp_path)
    deltas = peft_deltas(model)
    scale = settings.alpha / settings.rank
    assert len(params) == 2 * 7 * LAYERS
    for i in range(LAYERS):
        for t in ALL:
            part = "attn" if t in "qkvo" else "mlp"
            a, b = params[f"blocks.{i}.{part}.{t}_lora.a"], params[f"blocks.{i}.{part}.{t}_lora.b"]
            assert a.shape == (dims(model_type, t)[0], RANK)
            np.testing.assert_allclose(scale * a @ b, deltas[f"model.layers.{i}.{HF_NAME[t]}"].T,
                                       atol=1e-6, err_msg=f"{i} {t}")


@pytest.mark.parametrize("exclude", [
    ["down_proj"],  # a whole kind: no adapter on it
    ["model.layers.0.self_attn.q_proj", "layers.1.mlp.up_proj"],  # one layer's: a zero one
    r".*\.1\.self_attn\.(k|v)_proj",  # a regular expression over whole names
])
def test_peft_adapters_with_exclude_modules_read_as_peft_reads_them(tmp_path, exclude):
    modules = [HF_NAME[t].rsplit(".", 1)[1] for t in ALL]
    save_peft(tmp_path, "llama", target_modules=modules, exclude_modules=exclude)
    model = peft.PeftModel.from_pretrained(hf_model("llama"), tmp_path)
    deltas = peft_deltas(model)
    assert len(deltas) < len(ALL) * LAYERS  # peft itself left some modules unadapted
    settings, params = read_adapter_dir(tmp_path, trainrun_cfg("llama"), "llama")
    scale = settings.alpha / settings.rank
    for i in range(LAYERS):
        for t in settings.targets:
            part = "attn" if t in "qkvo" else "mlp"
            a, b = params[f"blocks.{i}.{part}.{t}_lora.a"], params[f"blocks.{i}.{part}.{t}_lora.b"]
            want = deltas.get(f"model.layers.{i}.{HF_NAME[t]}")
            np.testing.assert_allclose(scale * a @ b, 0 if want is None else want.T, atol=1e-6,
                                       err_msg=f"{i} {t}")
    assert ("down" in settings.targets) == (exclude != ["down_proj"])


def test_round_trip_keeps_the_adapters(tmp_path):
    cfg = trainrun_cfg("llama", ("q", "o", "down"))
    params = random_adapters("llama", ("q", "o", "down"))
    write_adapter_dir(params, cfg, "llama", "base", tmp_path)
    settings, back = read_adapter_dir(tmp_path, cfg, "llama")
    assert (settings.rank, settings.alpha, settings.targets) == (RANK, ALPHA, ("q", "o", "down"))
    for i in range(LAYERS):
        for t in ("q", "o", "down"):
            part = "attn" if t in "qkvo" else "mlp"
            a, b = adapter(params, i, t)
            np.testing.assert_array_equal(back[f"blocks.{i}.{part}.{t}_lora.a"], a)
            np.testing.assert_array_equal(back[f"blocks.{i}.{part}.{t}_lora.b"], b)


# ---- GPT-2 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "up", "down"), ("k",)])
def test_gpt2_written_adapters_load_in_peft_and_read_back(tmp_path, targets):
    cfg = trainrun_cfg("gpt2", targets)
    params = random_adapters("gpt2", targets)
    write_adapter_dir(params, cfg, "gpt2", "gpt2", tmp_path)
    model = peft.PeftModel.from_pretrained(hf_model("gpt2"), tmp_path).eval()
    want = expected_deltas("gpt2", params, targets)
    got = peft_deltas(model)
    assert sorted(got) == sorted(want)
    for name, delta in want.items():
        np.testing.assert_allclose(got[name], delta, atol=1e-6, err_msg=name)
    peft_logits = logits(model)
    np.testing.assert_allclose(peft_logits, merged_logits("gpt2", want), atol=1e-5)
    assert not np.allclose(peft_logits, logits(hf_model("gpt2")), atol=1e-3)

    settings, back = read_adapter_dir(tmp_path, cfg, "gpt2")
    assert (settings.rank, settings.alpha, settings.targets) == (RANK, ALPHA, targets)
    for i in range(LAYERS):
        for t in targets:
            part = "attn" if t in "qkvo" else "mlp"
            a, b = adapter(params, i, t)
            np.testing.assert_array_equal(back[f"blocks.{i}.{part}.{t}_lora.a"], a)
            np.testing.assert_array_equal(back[f"blocks.{i}.{part}.{t}_lora.b"], b)


def test_gpt2_peft_c_attn_splits_into_q_k_v(tmp_path):
    save_peft(tmp_path, "gpt2", target_modules=["c_attn", "c_proj", "c_fc"])
    settings, params = read_adapter_dir(tmp_path, trainrun_cfg("gpt2"), "gpt2")
    assert settings.rank == RANK and settings.targets == ("q", "k", "v", "o", "up", "down")
    deltas = peft_deltas(peft.PeftModel.from_pretrained(hf_model("gpt2"), tmp_path))
    scale = settings.alpha / settings.rank
    for i in range(LAYERS):
        c_attn = deltas[f"transformer.h.{i}.attn.c_attn"]  # Conv1D layout: [in, 3 out]
        for j, t in enumerate("qkv"):
            a, b = params[f"blocks.{i}.attn.{t}_lora.a"], params[f"blocks.{i}.attn.{t}_lora.b"]
            np.testing.assert_allclose(scale * a @ b, c_attn[:, j * D:(j + 1) * D], atol=1e-6)
        for t, name in GPT2_NAME.items():
            part = "attn" if t == "o" else "mlp"
            a, b = params[f"blocks.{i}.{part}.{t}_lora.a"], params[f"blocks.{i}.{part}.{t}_lora.b"]
            np.testing.assert_allclose(scale * a @ b, deltas[f"transformer.h.{i}.{name}"],
                                       atol=1e-6)


def test_gpt2_untrained_adapters_read_back_at_their_rank(tmp_path):
    """With b all zero the c_attn adapter cannot say which projection owns which columns; any
    choice adds zero, so q, k and v come back at the model's rank."""
    cfg = trainrun_cfg("gpt2", ("q", "v", "o"))
    params = random_adapters("gpt2", ("q", "v", "o"))
    for i in range(LAYERS):
        for t in ("q", "v", "o"):
            adapter(params, i, t)[1][:] = 0
    write_adapter_dir(params, cfg, "gpt2", "gpt2", tmp_path)
    settings, back = read_adapter_dir(tmp_path, cfg, "gpt2")
    assert (settings.rank, settings.alpha, settings.targets) == (RANK, ALPHA, ("q", "k", "v", "o"))
    assert back["blocks.1.attn.k_lora.a"].shape == (D, RANK)
    assert not any(np.any(v) for k, v in back.items() if k.endswith(".b"))


def test_gpt2_c_attn_of_another_rank_is_refused(tmp_path):
    save_peft(tmp_path, "gpt2", target_modules=["c_attn", "c_fc"], rank_pattern={"c_attn": 8})
    with pytest.raises(WeightsError, match="ranks differ"):
        read_adapter_dir(tmp_path, trainrun_cfg("gpt2"), "gpt2")


# ---- refusals ---------------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path) -> Path:
    cfg = trainrun_cfg("llama", ("q", "v"))
    return write_adapter_dir(random_adapters("llama", ("q", "v")), cfg, "llama", "b", tmp_path)


def refused(path: Path, match: str, model_type: str = "llama") -> str:
    with pytest.raises(WeightsError, match=match) as err:
        read_adapter_dir(path, trainrun_cfg(model_type), model_type)
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    return str(err.value)


def edit_config(path: Path, **fields: Any) -> None:
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    (path / ADAPTER_CONFIG).write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(("fields", "match"), [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias 'all'"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, "'lm_head' is not a linear layer"),
    ({"target_modules": ["q_proj", "v_proj", "k_proj"]}, "'k_proj' has no lora_A"),
    ({"rank_pattern": {"v_proj": 8}}, "rank 4 but adapter_config.json says 8"),
    ({"init_lora_weights": "pissa"}, "path_initial_model_for_weight_conversion"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"target_parameters": ["mlp.experts.down_proj"]},
     "target_parameters, which trainrun reads for a mixture of experts'"),
])
def test_config_fields_that_change_the_maths_are_refused(written, fields, match):
    edit_config(written, **fields)
    refused(written, match)


@pytest.mark.parametrize(("fields", "says"), [
    # each was a traceback (ValueError, TypeError, AttributeError or re.error)
    ({"r": "eight"}, "r 'eight', which is not a whole number from 1"),
    ({"lora_alpha": "x"}, "lora_alpha 'x', which is not a finite number"),
    ({"target_modules": ["q_proj", 3]}, r"target_modules\[1\] 3, which is not a list of module "
                                        "names, or one regular expression"),
    ({"rank_pattern": [1]}, r"rank_pattern \[1\], which is not an object of regular "
                            "expressions to ranks"),
    ({"rank_pattern": {"q_proj(": 4}}, r"rank_pattern key 'q_proj\(' is not a regular "
                                       "expression"),
    ({"alpha_pattern": {"[v": 8}}, r"alpha_pattern key '\[v' is not a regular expression"),
    ({"target_modules": "(q|v)_proj("}, "target_modules .* is not a regular expression"),
    # accepted before and converted
    ({"r": 4.0}, "r 4.0, which is not a whole number"),
    ({"rank_pattern": {"q_proj": "4"}}, "rank_pattern.q_proj '4', which is not an object"),
    ({"layers_to_transform": [0, -1]}, r"layers_to_transform\[1\] -1, which is not a layer "
                                       "index"),
    ({"use_rslora": "no"}, "use_rslora 'no', which is not true or false"),
])
def test_each_adapter_config_value_is_checked_before_use(written, fields, says):
    edit_config(written, **fields)
    with pytest.raises(UserError) as err:
        read_adapter_dir(written, trainrun_cfg("llama"), "llama")
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(written / ADAPTER_CONFIG)), message
    assert re.search(says, message), message
    assert message.endswith("correct it, or save the adapter again with PEFT's "
                            "save_pretrained"), message


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_integer_and_bool_adapter_weights_are_refused(written, dtype):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(written / ADAPTER_WEIGHTS))
    name = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"
    save_file({**tensors, name: (tensors[name] * 10).astype(dtype)},
              str(written / ADAPTER_WEIGHTS))
    message = refused(written, "has dtype")  # was: read, and trained, as floats
    assert message == (f"tensor {name} in {written / ADAPTER_WEIGHTS} has dtype "
                       f"{np.dtype(dtype)}; LoRA weights are floats: save the adapter's float "
                       "weights")


def test_peft_dora_is_refused(tmp_path):
    save_peft(tmp_path, "llama", target_modules=["q_proj"], use_dora=True)
    refused(tmp_path, "use_dora")


def test_peft_lm_head_target_is_refused(tmp_path):
    save_peft(tmp_path, "llama", target_modules=["q_proj", "lm_head"])
    refused(tmp_path, "'lm_head' is not a linear layer trainrun adapts")


def test_peft_modules_to_save_is_refused(tmp_path):
    save_peft(tmp_path, "llama", target_modules=["q_proj"], modules_to_save=["lm_head"])
    refused(tmp_path, "modules_to_save")


def test_peft_rank_pattern_with_two_ranks_is_refused(tmp_path):
    save_peft(tmp_path, "llama", target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8})
    message = refused(tmp_path, "ranks differ")
    assert "q 4, v 8" in message


def test_rank_pattern_for_one_layer_is_refused(tmp_path):
    save_peft(tmp_path, "llama", target_modules=["q_proj"],
              rank_pattern={"model.layers.1.self_attn.q_proj": 8})
    assert "q 4, q 8" in refused(tmp_path, "ranks differ")


def test_unknown_tensor_and_missing_tensor_are_refused(written):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(written / ADAPTER_WEIGHTS))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, name.replace("lora_A.weight", "lora_magnitude_vector"):
               np.ones(D, np.float32)}, str(written / ADAPTER_WEIGHTS))
    refused(written, "not a LoRA A/B weight")
    save_file({k: v for k, v in tensors.items() if k != name}, str(written / ADAPTER_WEIGHTS))
    refused(written, "lora_A.weight is missing")
    save_file({**tensors, name: np.ones((RANK, D + 1), np.float32)},
              str(written / ADAPTER_WEIGHTS))
    refused(written, "is the adapter for this base model")
    save_file({**tensors, name.replace("layers.0", "layers.5"): tensors[name]},
              str(written / ADAPTER_WEIGHTS))
    refused(written, "the model has 2 layers")


def test_pickled_weights_only_are_refused(written):
    (written / ADAPTER_WEIGHTS).rename(written / ADAPTER_BIN)
    refused(written, "safe_serialization=True")


def test_truncated_weights_are_refused(written):
    data = (written / ADAPTER_WEIGHTS).read_bytes()
    (written / ADAPTER_WEIGHTS).write_bytes(data[:len(data) // 2])
    refused(written, "is it complete")


@pytest.mark.parametrize("name", [ADAPTER_CONFIG, ADAPTER_WEIGHTS])
def test_an_adapter_file_linking_out_of_the_directory_is_refused(written, tmp_path_factory,
                                                                 name):
    elsewhere = tmp_path_factory.mktemp("elsewhere") / name
    (written / name).rename(elsewhere)
    (written / name).symlink_to(elsewhere)
    line = refused(written, "is a symbolic link to")
    assert line.startswith(f"{written}/{name} is a symbolic link to {elsewhere}, outside ")


def test_not_an_adapter_dir(tmp_path):
    refused(tmp_path, "not a PEFT adapter directory")


def test_export_without_adapters_is_refused(tmp_path):
    cfg = trainrun_cfg("llama").model_copy(update={"lora": None})
    with pytest.raises(WeightsError, match="no LoRA adapters"):
        adapter_files({}, cfg, "llama", None)
    with pytest.raises(WeightsError, match="model_type 'bert'"):
        adapter_files({}, trainrun_cfg("llama"), "bert", None)


# ---- mixtures of experts, Phi-3's fused layers ----------------------------------------------


@pytest.fixture(scope="module")
def family_bases(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models saved by ``transformers``: Qwen3-MoE (its layer 1 dense), Mixtral
    and Phi-3, two layers each."""
    from conftest import save_tiny_family

    root = tmp_path_factory.mktemp("peft-families")
    return {family: save_tiny_family(root / family, family, num_hidden_layers=2)
            for family in ("qwen3_moe", "mixtral", "phi3")}


def adapted_model(base: Path, seed: int = 3) -> Any:
    """The model at ``base`` with all-linear adapters of rank 3, every a and b drawn."""
    import jax

    import trainrun
    from trainrun.models import build_model

    model = trainrun.load(base)
    cfg = TransformerModel.model_validate({**model.config.model_dump(), "lora": {
        "rank": 3, "alpha": 6.0, "targets": ["all-linear"]}})
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))

    def fill(shape: Any, param: Any) -> np.ndarray:
        return (np.asarray(param) if param is not None
                else rng.normal(0, 0.2, shape.shape).astype(np.float32))

    params = jax.tree.map(fill, shapes, _with_missing(shapes, model.params))
    return trainrun.LanguageModel(cfg, params)


def _with_missing(shapes: Any, params: Any) -> Any:
    """``params`` shaped as ``shapes``: None where ``params`` has nothing (the adapters)."""
    if not isinstance(shapes, dict):
        return params
    return {k: _with_missing(v, params.get(k) if isinstance(params, dict) else None)
            for k, v in shapes.items()}


def without(model: Any, adapters: tuple[str, ...]) -> Any:
    """``model`` with the b of each adapter named in ``adapters`` zero."""
    import jax

    import trainrun

    def zero(path: Any, x: Any) -> Any:
        names = [getattr(p, "key", "") for p in path]
        return np.zeros_like(x) if names[-1] == "b" and names[-2] in adapters else x

    return trainrun.LanguageModel(model.config,
                                  jax.tree_util.tree_map_with_path(zero, model.params))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "groups"), [
    ("qwen3_moe", (("gate_lora", "up_lora", "down_lora"), ("router_lora",))),
    ("mixtral", (("gate_lora", "up_lora", "down_lora"), ("router_lora",))),
    ("phi3", (("qkv_lora",), ("gate_up_lora",))),
])
def test_all_linear_adapters_of_experts_and_fused_layers_load_in_peft_with_their_logits(
        family_bases, tmp_path, family, groups):
    """A mixture's adapters on its experts (PEFT's target_parameters) and router, and Phi-3's
    one adapter over each fused layer, load in PEFT onto the transformers model with the
    logits trainrun computes, and ``trainrun.load`` reads them back."""
    from conftest import hf_logits

    import trainrun

    base = family_bases[family]
    model = adapted_model(base)
    tokens = TOKENS  # below every family's vocabulary
    ours = np.asarray(model(tokens))
    assert np.abs(ours - np.asarray(trainrun.load(base)(tokens))).max() > 0.1
    for group in groups:  # the experts', the router's, each fused layer's adapters count
        assert np.abs(ours - np.asarray(without(model, group)(tokens))).max() > 0.1, group
    model_type = json.loads((base / "config.json").read_text())["model_type"]
    write_adapter_dir(model.params, model.config, model_type, str(base), tmp_path / "ad")
    config = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    if family == "phi3":
        assert config["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    else:
        assert config["target_parameters"] == ["mlp.experts.gate_up_proj",
                                               "mlp.experts.down_proj", "mlp.gate.weight"]
    np.testing.assert_allclose(hf_logits(base, tokens, adapters=tmp_path / "ad"), ours,
                               rtol=0, atol=1e-4)
    back = trainrun.load(tmp_path / "ad")
    assert back.config.lora == model.config.lora.model_copy(
        update={"targets": tuple(t for t in ("q", "k", "v", "o", "gate", "up", "down",
                                             "router") if t in model.config.adapted)})
    np.testing.assert_allclose(np.asarray(back(tokens)), ours, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_peft_adapters_on_the_experts_read_back_with_peft_logits(family_bases, tmp_path):
    """An adapter PEFT made on Qwen3-MoE's experts, its router and q_proj (one rank for the
    fused gate_up_proj, drawn at random) reads back into trainrun with PEFT's logits."""
    import trainrun

    base = family_bases["qwen3_moe"]
    torch.manual_seed(1)
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj"], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                           "mlp.gate.weight"])).eval()
    model.save_pretrained(tmp_path)
    back = trainrun.load(tmp_path)
    assert back.config.lora.targets == ("q", "gate", "up", "down", "router")
    np.testing.assert_allclose(np.asarray(back(TOKENS)), logits(model), rtol=0, atol=1e-4)
