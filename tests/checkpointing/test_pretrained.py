"""init.from: a fresh run starts from a Hugging Face GPT-2 directory, another run's params or
its whole state; a source that does not fit is one line, exit 2, nothing written."""

from __future__ import annotations

import errno
import io
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gpt2_logits, save_tiny_gpt2

from trainrun.checkpointing.init_from import initial_state, resolved, source_kind
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.data import build_dataset
from trainrun.models import build_model
from trainrun.models.huggingface import WeightsError
from trainrun.models.transformer import bind_transformer
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import abstract_state
from trainrun.training.loop import run

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

TOKENS = np.random.default_rng(1).integers(0, 256, (2, 24))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), vocab=256)


def hf_logits(path) -> np.ndarray:
    return gpt2_logits(path, TOKENS)


def finetune(tmp_path, source, *extra: str):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    return resolved(load_config("lm", [
        "steps=6", "steps_per_call=3", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=2", "optimizer.lr=0.001", "model.d_model=32",
        "model.layers=2", "model.heads=2", "model.seq_len=32", "model.positions=learned",
        "model.bias=true", f"init.from={source}", f"data.paths=[{corpus}]", "data.seq_len=32",
        "data.batch_size=4", *extra]))


@pytest.fixture(scope="module")
def finetuned(gpt2_dir, tmp_path_factory):
    """A 6-step fine-tune from the GPT-2 directory: (config, its run directory)."""
    tmp_path = tmp_path_factory.mktemp("finetune")
    config = finetune(tmp_path, gpt2_dir)
    run(config, tmp_path / "run", out=io.StringIO())
    return config, tmp_path / "run"


def start_of(config):
    """(model, optimizer, policy, abstract state) of a config."""
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 6)
    policy = policy_from_config(config.precision)
    return model, optimizer, policy, abstract_state(model, optimizer, config.seed, policy)


@pytest.mark.slow
def test_init_from_a_gpt2_directory_has_its_logits_and_trains_from_them(gpt2_dir, finetuned,
                                                                       tmp_path):
    config, run_dir = finetuned
    model, optimizer, policy, abstract = start_of(config)
    start = initial_state(config, model, optimizer, policy, None, abstract)
    logits = np.asarray(bind_transformer(config.model)(start.params)(jnp.asarray(TOKENS))[0])
    np.testing.assert_allclose(logits, hf_logits(gpt2_dir), rtol=0, atol=1e-4)

    # The checkpoint file alone (GPT-2's tensor names, no config.json) loads the same.
    from_file = finetune(tmp_path, gpt2_dir / "model.safetensors")
    same = initial_state(from_file, model, optimizer, policy, None, abstract)
    for a, b in zip(jax.tree.leaves(same.params), jax.tree.leaves(start.params), strict=True):
        np.testing.assert_array_equal(a, b)

    # Through the run: its first logged loss is the loaded model's loss on the first batch.
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    batch = build_dataset(config.data, seed=config.seed)[0]
    want = float(model.loss(start.params, batch, jax.random.key(0))[0])
    assert first["step"] == 1 and abs(first["loss"] - want) < 1e-5

    # and its export loads back in transformers with the trained model's logits
    assert main(["export", str(run_dir), "--to", str(tmp_path / "out")]) == 0
    from trainrun.checkpointing.reader import latest_params

    _, trained = latest_params(run_dir, config)
    ours = np.asarray(bind_transformer(config.model)(trained)(jnp.asarray(TOKENS))[0])
    assert not np.allclose(ours, logits, atol=1e-4)  # it trained
    np.testing.assert_allclose(hf_logits(tmp_path / "out"), ours, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_init_from_another_run_takes_its_params_or_its_whole_state(finetuned, tmp_path):
    config, base_dir = finetuned
    from trainrun.checkpointing.reader import latest_state

    _, base = latest_state(base_dir, config)
    model, optimizer, policy, abstract = start_of(config)
    params = initial_state(finetune(tmp_path, base_dir), model, optimizer, policy, None,
                           abstract)
    assert int(params.step) == 0
    for a, b in zip(jax.tree.leaves(params.params), jax.tree.leaves(base.params), strict=True):
        np.testing.assert_array_equal(a, b)
    whole = initial_state(finetune(tmp_path, base_dir, "init.load=state"), model,
                          optimizer, policy, None, abstract)
    assert int(whole.step) == 6
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_source_that_does_not_fit_is_one_line_and_writes_nothing(gpt2_dir, tmp_path, cli):
    with pytest.raises(WeightsError, match=r"d_model=64 in the config, but .*n_embd 32"):
        finetune(tmp_path, gpt2_dir, "model.d_model=64")
    # a weights file alone has no config.json: its tensors are checked against the model
    wider = finetune(tmp_path, gpt2_dir / "model.safetensors", "model.d_model=64")
    model, optimizer, policy, abstract = start_of(wider)
    with pytest.raises(WeightsError, match=r"transformer\.wte\.weight has shape \(256, 32\)"):
        initial_state(wider, model, optimizer, policy, None, abstract)
    result = cli("train", "--config", "mlp", "--run-dir", str(tmp_path / "r"),
                 f"init.from={tmp_path / 'nothing'}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "init.from" in lines[0], result.stderr
    assert not (tmp_path / "r").exists()


def test_a_model_section_that_contradicts_config_json_is_refused_naming_both(gpt2_dir, tmp_path):
    # Each was accepted before and gave wrong logits or a KeyError traceback.
    for override, says in (("model.positions=rope", "positions='rope' in the config"),
                           ("model.bias=false", "bias=False in the config"),
                           ("model.heads=4", "n_head 2"),
                           ("model.tie_embeddings=false", "tie_word_embeddings True")):
        with pytest.raises(WeightsError, match=re.escape(says)):
            finetune(tmp_path, gpt2_dir, override)


def test_each_kind_of_source_that_is_not_read_gets_its_own_line(tmp_path):
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    (torch_dir / "config.json").write_text('{"model_type": "gpt2"}')
    (torch_dir / "pytorch_model.bin").write_bytes(b"\0")
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.bin").write_bytes(b"\0")
    (tmp_path / "other").mkdir()
    cases = {str(torch_dir): "pytorch_model.bin, which trainrun does not read",
             str(no_weights): "weights are missing",
             str(tmp_path / "model.bin"): "a PyTorch .bin file, which trainrun does not read",
             str(tmp_path / "nothing"): "no such file or directory",
             "meta-llama/Llama-3.2-1B": "a hub name is not fetched",
             str(tmp_path / "other"): "not a trainrun run directory, a Hugging Face model"}
    for source, says in cases.items():
        with pytest.raises(WeightsError, match=re.escape(says)):
            source_kind(Path(source))


@pytest.mark.slow
def test_a_run_as_init_from_gives_its_model(finetuned, tmp_path):
    _, base_dir = finetuned
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    # The finetune config names no size: the run's model (GPT-2's layout, 32 wide) is taken.
    config = resolved(load_config("finetune", [f"init.from={base_dir}", "data.seq_len=32",
                                               f"data.paths=[{corpus}]"]))
    assert (config.model.d_model, config.model.positions, config.model.bias) == (32, "learned",
                                                                                  True)
    with pytest.raises(WeightsError, match=r"d_model=48 in the config, but .*config\.yaml has "
                                           r"d_model 32"):
        resolved(load_config("finetune", [f"init.from={base_dir}", "model.d_model=48"]))


@pytest.mark.slow
def test_a_tied_config_whose_file_holds_another_head_starts_untied_from_that_head(tmp_path):
    """transformers loads such a head as its own (PreTrainedModel.tie_weights ties only equal
    tensors); the run starting from it had tied it to the embedding, logits ~1 apart."""
    path = save_tiny_gpt2(tmp_path / "gpt2", vocab=256, tie_word_embeddings=False)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": True}))
    config = finetune(tmp_path, path)
    model, optimizer, policy, abstract = start_of(config)
    start = initial_state(config, model, optimizer, policy, None, abstract)
    logits = np.asarray(bind_transformer(config.model)(start.params)(jnp.asarray(TOKENS))[0])
    np.testing.assert_allclose(logits, hf_logits(path), rtol=0, atol=1e-4)
    assert config.model.tie_embeddings is False and "head" in start.params


def deny_reading(monkeypatch, file: Path) -> None:
    """Reading ``file`` fails as it does for a user without permission (the tests run as root,
    whom mode bits do not stop): ``open`` raises EACCES, and safetensors, which reports any
    failure to open as a missing file, says "No such file or directory"."""
    import builtins

    import safetensors

    real_open, real_safe_open = builtins.open, safetensors.safe_open

    def opened(name, *args, **kwargs):
        if Path(name) == file:
            raise PermissionError(errno.EACCES, "Permission denied", str(name))
        return real_open(name, *args, **kwargs)

    def safe_opened(name, *args, **kwargs):
        if Path(name) == file:
            raise FileNotFoundError(f"No such file or directory: {name}")
        return real_safe_open(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", opened)
    monkeypatch.setattr(safetensors, "safe_open", safe_opened)


# read while the model is resolved (tied: the head is compared), or at init, after the data
@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_weights_the_user_cannot_read_are_named_as_permission_denied(tmp_path, monkeypatch,
                                                                    capsys, tied):
    path = save_tiny_gpt2(tmp_path / "gpt2", vocab=256, tie_word_embeddings=tied)
    weights = path / "model.safetensors"
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    deny_reading(monkeypatch, weights)
    capsys.readouterr()
    code = main(["train", "--config", "finetune", "--run-dir", str(tmp_path / "run"),
                 f"init.from={path}", "steps=2", "optimizer.schedule.warmup=0",
                 "eval.every=0", f"data.paths=[{corpus}]", "data.seq_len=32",
                 "data.batch_size=2", "metrics.tensorboard=false"])
    err = capsys.readouterr().err
    # was: "error: cannot read ...: No such file or directory ...", exit 2
    assert (code, err) == (1, f"error: permission denied: {weights}; give this user access or "
                              "another path\n")
    assert not (tmp_path / "run").exists()
    import trainrun
    from trainrun.errors import ReadFailed

    with pytest.raises(ReadFailed, match=f"^permission denied: {re.escape(str(weights))};"):
        trainrun.load(path)
