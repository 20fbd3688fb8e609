"""``trainrun.load`` on a run directory generates within the context its architecture gives
(the ``init.from`` model's ``max_position_embeddings``, a learned table's size, any length for
rotary positions from scratch), not its training rows' length, and within ``context=`` where
given: greedy decoding of 300 tokens from a run trained on 24-token rows is ``transformers``'
``generate`` on the run's export, token for token."""

from __future__ import annotations

import io
import shutil
import warnings

import numpy as np
import pytest
from conftest import hf_greedy, save_tiny_causal_lm, save_tiny_family

import trainrun
from trainrun.checkpointing.init_from import resolved
from trainrun.checkpointing.run_context import ROPE_CONTEXT, ContextRefused, run_model, within
from trainrun.config import load_config
from trainrun.program.decode import ContextWarning

pytest.importorskip("transformers", reason="the tests' extra holds transformers")


def finetune(source, corpus, *overrides: str):
    return resolved(load_config("finetune", [
        "steps=2", "steps_per_call=2", "checkpoint.every=0", "eval.every=0",
        "optimizer.lr=0.01", "optimizer.schedule.warmup=1", f"init.from={source}",
        f"data.paths=[{corpus}]", "data.seq_len=24", "data.batch_size=2", *overrides]))


@pytest.mark.slow
def test_a_run_decodes_300_tokens_as_transformers_generates_its_export(tmp_path):
    """Before, the run's 24-token rows were its context: decoding went on from the last 12
    tokens whenever it filled, and departed from transformers within the first 100 tokens."""
    from trainrun.export import export_run
    from trainrun.training.loop import run

    source = save_tiny_family(tmp_path / "phi3", "phi3", vocab_size=256,
                              max_position_embeddings=512)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 96)) * 40)
    run(finetune(source, corpus), tmp_path / "run", out=io.StringIO())
    export_run(tmp_path / "run", tmp_path / "export")

    model = trainrun.load(tmp_path / "run")
    assert model.config.seq_len == 512 and model.step == 2
    prompt = np.frombuffer(b"def f(x):", np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the context: nothing to say
        got = model.generate(prompt, 300)
    want = hf_greedy(tmp_path / "export", prompt, 300)
    assert len(got) == len(want) == 309
    np.testing.assert_array_equal(got, want)

    with pytest.raises(ContextRefused, match=r"^context=513: the model of .* reads at most 512 "
                                        r"positions \(the max_position_embeddings of "):
        trainrun.load(tmp_path / "run", context=513)


@pytest.mark.slow
def test_the_context_of_a_run_is_its_architectures(tmp_path):
    """What ``load``, ``sample`` and ``eval`` decode within, before a checkpoint is read."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 96)) * 40)
    source = save_tiny_causal_lm(tmp_path / "qwen2", "qwen2", vocab_size=256,
                                 max_position_embeddings=320)
    config = finetune(source, corpus)
    assert config.model.seq_len == 24  # type: ignore[union-attr]  # the rows it trains on
    assert run_model(config).seq_len == 320  # the source's max_position_embeddings
    assert run_model(config, 100).seq_len == 100
    with pytest.raises(ContextRefused, match="context=321: the model of the run reads at most 320"):
        run_model(config, 321)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ContextRefused, match="give a number of positions above 1"):
            run_model(config, bad)  # type: ignore[arg-type]
    # A run started from a run that started from the model: the model's context still.
    forked = config.model_copy(update={"init": config.init.model_copy(
        update={"from_": str(tmp_path / "run")})})
    (tmp_path / "run").mkdir()
    from trainrun import rundir
    from trainrun.config import dump_yaml

    (tmp_path / "run" / rundir.CONFIG).write_text(dump_yaml(config))
    assert run_model(forked).seq_len == 320
    # The source moved away: the run's own length, and any longer context where asked.
    shutil.rmtree(source)
    assert run_model(config).seq_len == 24 and run_model(config, 1000).seq_len == 1000

    scratch = load_config("lm", [f"data.paths=[{corpus}]", "data.seq_len=24"])
    assert run_model(scratch).seq_len == ROPE_CONTEXT  # rotary: any length
    assert run_model(scratch, 10_000).seq_len == 10_000
    learned = load_config("lm", [f"data.paths=[{corpus}]", "data.seq_len=24",
                                 "model.positions=learned", "model.seq_len=48"])
    assert run_model(learned).seq_len == 48
    assert run_model(learned, 30).seq_len == 30
    with pytest.raises(ContextRefused, match=r"reads at most 48 positions \(a table of 48 learned "
                                        "positions\\); give at most 48"):
        run_model(learned, 49)


@pytest.mark.slow
def test_a_learned_model_within_a_shorter_context_computes_its_first_positions(tmp_path):
    import jax

    from trainrun.models import build_model

    config = load_config("lm", [f"data.paths=[{tmp_path}]", "data.seq_len=32",
                                "model.d_model=32", "model.layers=1", "model.heads=2",
                                "model.positions=learned", "model.init_std=0.5"])
    params = build_model(config.model).init(jax.random.key(0))
    short_model = run_model(config, 20)
    whole = trainrun.LanguageModel(run_model(config), params)
    short = trainrun.LanguageModel(short_model, within(short_model, params))
    assert (whole.config.seq_len, short.config.seq_len) == (32, 20)
    assert short.params["positions"].shape[0] == 20
    tokens = np.frombuffer(b"def add(a, b):\n    ", np.uint8)[None].astype(np.int32)
    np.testing.assert_allclose(short(tokens), whole(tokens), rtol=0, atol=1e-6)
    prompt = np.frombuffer(b"def ", np.uint8)
    with pytest.warns(ContextWarning, match="^the answer stopped before 40 tokens: the model "
                                            "reads 20 positions"):
        stopped = short.generate(prompt, 40)
    assert stopped.tolist() == whole.generate(prompt, 16).tolist()
