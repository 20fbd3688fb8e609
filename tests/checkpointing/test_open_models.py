"""Fine-tuning the Llama family end to end: a tiny random Llama made by `transformers` (no
download) trains from its directory with no size in the run's config, exports back to a
directory `transformers` evaluates to trainrun's eval loss, and LoRA adapters travel to and from
PEFT's adapter directory with the same logits."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest
from conftest import hf_logits, losses, save_tiny_causal_lm

import trainrun
from trainrun import rundir
from trainrun.checkpointing.init_from import resolved
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.data import build_eval_dataset
from trainrun.program.optim import param_name
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

TOKENS = np.random.default_rng(2).integers(0, 256, (2, 24))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = save_tiny_causal_lm(tmp_path_factory.mktemp("llama") / "model", "llama",
                               vocab_size=256, max_shard_size="100KB")
    # stands for the tokenizer files an export copies
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    return path


def finetune(tmp_path, source, *extra: str):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 80)
    return resolved(load_config("finetune", [
        "steps=8", "steps_per_call=4", "checkpoint.every=0", "eval.every=8", "eval.batches=2",
        "eval.batch_size=4", "optimizer.lr=0.003", "optimizer.schedule.warmup=2",
        f"init.from={source}", f"data.paths=[{corpus}]", "data.seq_len=32",
        "data.batch_size=4", "data.eval_fraction=0.2", *extra]))


def torch_eval_loss(path, config) -> float:
    """The mean next-token loss `transformers` computes over the run's eval batches."""
    torch = pytest.importorskip("torch")
    data = build_eval_dataset(config.data, config.eval.batch_size)
    losses = []
    for i in range(config.eval.batches):
        tokens = np.asarray(data[i]["tokens"], np.int64)
        logits = hf_logits(path, tokens[:, :-1])
        losses.append(float(torch.nn.functional.cross_entropy(
            torch.from_numpy(logits).reshape(-1, logits.shape[-1]),
            torch.from_numpy(tokens[:, 1:]).reshape(-1))))
    return float(np.mean(losses))


@pytest.mark.slow
def test_a_llama_fine_tune_exports_to_what_transformers_evaluates_the_same(llama_dir, tmp_path):
    config = finetune(tmp_path, llama_dir)
    assert (config.model.kv_heads, config.model.mlp, config.model.seq_len) == (2, "swiglu", 32)
    start = trainrun.load(llama_dir)
    run(config, tmp_path / "run", out=io.StringIO())
    trained = trainrun.load(tmp_path / "run")
    assert not np.allclose(trained(TOKENS), start(TOKENS), atol=1e-3)  # it trained

    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "out"),
                 "--shard-size", "200KB"]) == 0
    out = tmp_path / "out"
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["num_key_value_heads"] == 2
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)  # the source's, kept
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    assert (out / "generation_config.json").is_file()
    np.testing.assert_allclose(hf_logits(out, TOKENS), trained(TOKENS), rtol=0, atol=1e-4)
    ours = read_metrics(tmp_path / "run" / rundir.METRICS, split="eval")[-1]["loss"]
    assert abs(torch_eval_loss(out, config) - ours) < 1e-4


@pytest.mark.slow
def test_lora_adapters_go_to_peft_and_back_with_the_same_logits(llama_dir, tmp_path):
    pytest.importorskip("peft")
    config = finetune(tmp_path, llama_dir, "model.lora={rank: 4, alpha: 8, targets: all-linear}")
    run(config, tmp_path / "run", out=io.StringIO())
    trained = trainrun.load(tmp_path / "run")
    base = trainrun.load(llama_dir)
    assert not np.allclose(trained(TOKENS), base(TOKENS), atol=1e-4)  # the adapters count

    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "adapters")]) == 0
    adapters = tmp_path / "adapters"
    settings = json.loads((adapters / "adapter_config.json").read_text())
    assert settings["base_model_name_or_path"] == str(llama_dir.absolute())
    assert sorted(settings["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    np.testing.assert_allclose(hf_logits(llama_dir, TOKENS, adapters=adapters),
                               trained(TOKENS), rtol=0, atol=1e-4)
    # and back: the adapter directory loads, and starts a run, with the same adapters
    np.testing.assert_allclose(trainrun.load(adapters)(TOKENS), trained(TOKENS), rtol=0,
                               atol=1e-5)
    again = finetune(tmp_path, adapters)
    assert again.model.lora is not None and again.model.lora.rank == 4
    assert again.optimizer.trainable == [r"_lora\.(a|b)$"]

    # --merge: each targeted weight is the base's plus alpha/r times the adapters' product
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "merged"),
                 "--merge"]) == 0
    from safetensors.numpy import load_file

    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    flat = {param_name(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(trained.params)}
    for ours, theirs in (("attn.k", "self_attn.k_proj"), ("mlp.gate", "mlp.gate_proj")):
        a, b = flat[f"blocks.1.{ours}_lora.a"], flat[f"blocks.1.{ours}_lora.b"]
        want = flat[f"blocks.1.{ours}.kernel"] + 2.0 * (a @ b)
        np.testing.assert_allclose(merged[f"model.layers.1.{theirs}.weight"], want.T, rtol=0,
                                   atol=1e-6)
    np.testing.assert_allclose(hf_logits(tmp_path / "merged", TOKENS), trained(TOKENS),
                               rtol=0, atol=1e-4)


def test_a_size_the_config_repeats_must_agree_with_config_json(llama_dir, tmp_path, capsys):
    code = main(["train", "--config", "finetune", "--run-dir", str(tmp_path / "runs" / "x"),
                 f"init.from={llama_dir}", "model.heads=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "model.heads" in err[0] and "heads=8" in err[0] and "num_attention_heads 4" in err[0]
    assert not (tmp_path / "runs").exists()
    # a size that agrees is fine
    assert finetune(tmp_path, llama_dir, "model.heads=4", "model.kv_heads=2").model.heads == 4


@pytest.mark.slow
def test_loading_onto_an_fsdp_mesh_places_the_same_model(llama_dir, tmp_path, cli):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 80)
    args = ["train", "--config", "finetune", f"init.from={llama_dir}", "steps=2",
            "steps_per_call=1", "metrics.every=1", "eval.every=0", "checkpoint.every=0",
            f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=4",
            "metrics.tensorboard=false", "optimizer.schedule.warmup=1"]
    one = cli(*args[:3], "--run-dir", str(tmp_path / "one"), *args[3:])
    # every param with a dimension 4 divides is split over the 4 devices as it is read
    four = cli(*args[:3], "--run-dir", str(tmp_path / "four"), *args[3:], "mesh.data=1",
               "mesh.fsdp=4", "mesh.fsdp_min_size=0", devices=4)
    assert one.returncode == 0 and four.returncode == 0, one.stderr + four.stderr
    np.testing.assert_allclose(losses(tmp_path / "four"), losses(tmp_path / "one"), rtol=0,
                               atol=1e-5)


def test_adapters_a_model_directory_lacks_are_drawn_as_a_fresh_run_draws_them(llama_dir,
                                                                               tmp_path):
    """The base params read from the directory, the LoRA adapters (drawn on a thread of their
    own while it is read) the very bits ``init_state`` draws for the same model and seed."""
    from trainrun.checkpointing.init_from import placed_params, readers
    from trainrun.models import build_model
    from trainrun.program.optim import build_optimizer
    from trainrun.program.state import init_state

    config = finetune(tmp_path, llama_dir, "model.lora={rank: 4, targets: all-linear}")
    model = build_model(config.model)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    loaded = placed_params(readers(str(llama_dir), config.model, abstract), config.seed,
                           abstract, None)
    drawn = init_state(model, build_optimizer(config.optimizer, 8), config.seed).params
    loaded, drawn = ({param_name(p): np.asarray(x)
                      for p, x in jax.tree_util.tree_leaves_with_path(params)}
                     for params in (loaded, drawn))
    adapters = [name for name in loaded if "_lora." in name]
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 layers in 2 blocks
    assert all(loaded[n].tobytes() == drawn[n].tobytes() for n in adapters)
    assert any(loaded[n].any() for n in adapters)  # the A matrices are drawn, not zeros
    # the base's matrices are the directory's (its norms are ones either way)
    base = [name for name in loaded if "_lora." not in name and loaded[name].ndim == 2]
    assert base and not any(loaded[n].tobytes() == drawn[n].tobytes() for n in base)
