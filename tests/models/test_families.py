"""The Hugging Face families as one module each: ``families.FAMILIES`` maps every model_type
to its ``Family``, defined in a module a reader finds by the family's name; no module outside
``families/`` names a model_type; and a family registered there is read, written and
adapted by the shared code with nothing else changed."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from trainrun.checkpointing.init_from import model_of, readers
from trainrun.config import LoraConfig, TransformerModel
from trainrun.models import build_model, huggingface, peft
from trainrun.models.families import FAMILIES, MODEL_TYPES
from trainrun.models.families.family import Family
from trainrun.models.families.llama_layout import LlamaLayout, family

SRC = Path(__file__).resolve().parents[2] / "src" / "trainrun"
FAMILIES_DIR = SRC / "models" / "families"


def test_each_model_type_is_a_family_of_a_module_named_for_it():
    assert MODEL_TYPES == tuple(FAMILIES) == huggingface.MODEL_TYPES
    for model_type, found in FAMILIES.items():
        assert isinstance(found, Family) and found.model_type == model_type
        modules = [p.stem for p in FAMILIES_DIR.glob("*.py")
                   if f'model_type="{model_type}"' in p.read_text()]
        assert len(modules) == 1, (model_type, modules)
        assert model_type.startswith(modules[0]), (model_type, modules)


def test_no_module_outside_the_families_names_a_model_type():
    """Family knowledge lives in families/: no string in code elsewhere is a model_type (a
    ``model_type == "gpt2"``, a tuple of families), docstrings and comments apart."""
    named = []
    for path in sorted(SRC.rglob("*.py")):
        if FAMILIES_DIR in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in MODEL_TYPES:
                named.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert named == []


@pytest.fixture
def registered(monkeypatch) -> Family:
    """A family of the Llama layout (q/k norms, an MLP with biases) registered under a
    model_type of its own, as a new module under families/ registers one."""
    made = family(LlamaLayout(model_type="tiny_llama", title="Tiny Llama",
                              architecture="TinyLlamaForCausalLM", qk_norm=True, mlp_bias=True))
    monkeypatch.setitem(FAMILIES, "tiny_llama", made)
    return made


def tiny_cfg(**changes) -> TransformerModel:
    return TransformerModel(vocab=64, d_model=32, layers=2, heads=4, kv_heads=2, seq_len=16,
                            mlp="swiglu", mlp_hidden=48, norm="rmsnorm", positions="rope",
                            tie_embeddings=False, qk_norm=True, mlp_bias=True, **changes)


def random_params(cfg: TransformerModel) -> dict:
    """Params of ``cfg``'s shapes, every value drawn (adapters' b too)."""
    rng = np.random.default_rng(1)
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    return jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(np.float32), shapes)


def test_a_registered_family_is_written_and_read_back_with_nothing_else_changed(registered,
                                                                               tmp_path):
    cfg = tiny_cfg()
    params = random_params(cfg)
    huggingface.write_model_dir(params, cfg, tmp_path, model_type="tiny_llama")
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["TinyLlamaForCausalLM"] and written["mlp_bias"]
    assert set(huggingface.Tensors.of(tmp_path).names) == {
        s.name for s in registered.tensor_map(cfg).values()}
    read = model_of(tmp_path, seq_len=16)
    assert read == cfg
    found = readers(str(tmp_path), read, params)
    ours = huggingface.dotted(params)
    assert found.keys() == ours.keys()
    for name, value in ours.items():
        np.testing.assert_array_equal(found[name](None), value)


def test_a_registered_family_carries_peft_adapters_both_ways(registered, tmp_path):
    cfg = tiny_cfg(lora=LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down")))
    params = random_params(cfg)
    peft.write_adapter_dir(params, cfg, "tiny_llama", "base", tmp_path)
    settings, adapters = peft.read_adapter_dir(tmp_path, cfg, "tiny_llama")
    assert settings.config() == cfg.lora
    ours = huggingface.dotted(params)
    assert adapters.keys() == {n for n in ours if "_lora." in n}
    for name, value in adapters.items():
        np.testing.assert_array_equal(value, ours[name])
