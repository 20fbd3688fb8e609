"""The pad token's embedding row through each kind of run: started from a Hugging Face model
whose config.json names a pad token, a next-token, DPO, GRPO or LoRA run (with the embedding
trainable) leaves that row as it was while the rows around it learn, as transformers'
``padding_idx`` does; a run directory and its export carry the row on; a run from scratch
says which rows learn, every one unless ``model.pad_id`` names one."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

import trainrun
from trainrun.checkpointing.init_from import model_of, resolved
from trainrun.checkpointing.reader import latest_params
from trainrun.config import load_config
from trainrun.export import export_run
from trainrun.models import build_model
from trainrun.program.state import root_keys
from trainrun.training.loop import run

transformers = pytest.importorskip("transformers", reason="the tests' extra holds transformers")
torch = pytest.importorskip("torch")

PAD, OTHER = ord("s"), ord("u")  # bytes of every chat prompt ("user", "assistant")
COMMON = ["steps=2", "steps_per_call=2", "checkpoint.every=2", "metrics.tensorboard=false"]
WARM = ["eval.every=0", "optimizer.schedule.warmup=0"]  # the configs with eval and warm-up
# A reward that varies between completions: group-relative advantages that are not all zero.
REWARDS = '''
def letters(prompts, completions, **fields):
    return [float(sum(c.isalpha() for c in message[-1]["content"])) for message in completions]
'''
RUNS = {
    "next-token": ("chat", [*WARM, "model.d_model=64", "model.layers=2",
                            "data.synthetic_examples=64", "data.batch_size=4"]),
    "dpo": ("dpo", [*WARM, "data.synthetic_examples=64", "data.batch_size=4"]),
    "grpo": ("grpo", ["steps_per_call=1", "rl.prompts=2", "rl.group=4",
                      "rl.completion_tokens=8", "data.synthetic_examples=64"]),
    "lora": ("chat", [*WARM, "model.d_model=64", "model.layers=2", "data.synthetic_examples=64",
                      "data.batch_size=4", "model.lora={rank: 4, targets: all-linear}",
                      "optimizer.trainable=[_lora, embed]"]),
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A random Llama of the built-in chat configs' vocabulary (256 bytes and the special
    tokens) whose config.json names ``PAD`` the pad token."""
    path = tmp_path_factory.mktemp("llama-pad")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, pad_token_id=PAD)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def trained(kind: str, source: Path, tmp_path: Path) -> tuple[Path, np.ndarray, str]:
    """A ``kind`` run of ``RUNS`` from ``source``: its directory, its embedding table after
    training, and what it said."""
    name, extra = RUNS[kind]
    if kind == "grpo":
        (tmp_path / "rewards.py").write_text(REWARDS)
        extra = [*extra, "rl.rewards=" + json.dumps([{"name": f"{tmp_path}/rewards.py:letters"}])]
    # the source saves no tokenizer: the runs keep the configs' byte tokenizer
    config = load_config(name, [*COMMON, *extra, f"init.from={source}", "data.tokenizer=bytes"])
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
        run(config, tmp_path / kind, out=out)
    _, params = latest_params(tmp_path / kind, resolved(config))
    return tmp_path / kind, np.asarray(params["embed"]["embedding"]), out.getvalue()


@pytest.fixture(scope="module")
def runs(llama_dir, tmp_path_factory) -> Callable[[str], tuple[Path, np.ndarray, str]]:
    """``trained`` from ``llama_dir``, each kind trained once for the module's tests."""
    done: dict[str, tuple[Path, np.ndarray, str]] = {}

    def of(kind: str) -> tuple[Path, np.ndarray, str]:
        if kind not in done:
            done[kind] = trained(kind, llama_dir, tmp_path_factory.mktemp(kind))
        return done[kind]

    return of


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(RUNS))
def test_each_kind_of_run_leaves_the_pad_row_of_its_source_as_it_was(kind, llama_dir, runs):
    before = np.asarray(trainrun.load(llama_dir).params["embed"]["embedding"])
    _, after, said = runs(kind)
    assert not np.array_equal(after[OTHER], before[OTHER])  # the step trained the embedding
    np.testing.assert_array_equal(after[PAD], before[PAD])
    assert f"embedding: row {PAD}, the pad token's (model.pad_id), learns nothing" in said


@pytest.mark.slow
def test_a_run_directory_and_its_export_carry_the_pad_row_on(runs, tmp_path):
    run_dir, _, _ = runs("next-token")
    name, extra = RUNS["next-token"]
    after_run = resolved(load_config(name, [*COMMON, *extra, f"init.from={run_dir}"]))
    assert after_run.model.pad_id == PAD
    export_run(run_dir, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["pad_token_id"] == PAD
    assert model_of(tmp_path / "export").pad_id == PAD


@pytest.mark.slow
@pytest.mark.parametrize("pad", [None, PAD])
def test_a_run_from_scratch_says_which_rows_learn(pad, tmp_path):
    config = load_config("chat", [*COMMON, *WARM, "model.d_model=32", "model.layers=1",
                                  "data.synthetic_examples=64", "data.batch_size=4",
                                  *([f"model.pad_id={pad}"] if pad is not None else [])])
    out = io.StringIO()
    run(config, tmp_path / "run", out=out)
    before = np.asarray(jax.jit(build_model(config.model).init)(
        root_keys(config.seed)[0])["embed"]["embedding"])
    _, params = latest_params(tmp_path / "run", config)
    after = np.asarray(params["embed"]["embedding"])
    # the init drawn again here is the run's within rounding; a step moves a row by ~lr
    assert np.abs(after[OTHER] - before[OTHER]).max() > 1e-4
    if pad is None:
        assert "embedding: every row learns from its lookups" in out.getvalue()
        assert np.abs(after[PAD] - before[PAD]).max() > 1e-4
    else:
        assert f"embedding: row {PAD}, the pad token's" in out.getvalue()
        np.testing.assert_allclose(after[PAD], before[PAD], rtol=0, atol=1e-7)
