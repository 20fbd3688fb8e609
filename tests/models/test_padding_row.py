"""The pad token's embedding row, as transformers builds it: every family whose
``nn.Embedding`` takes ``padding_idx = config.pad_token_id`` gives that row no gradient from its
lookups (its value is still read, and a tied head's gradient still reaches it). trainrun reads
the same row from config.json (the family's default where the key is absent), computes
torch's gradient of the embedding, and writes the row back out in an export."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAMILY_CONFIGS, TINY, save_tiny_family

import trainrun
from trainrun.checkpointing.init_from import model_of
from trainrun.config import TransformerModel
from trainrun.models import build_model
from trainrun.models.huggingface import WeightsError, architecture, write_model_dir

transformers = pytest.importorskip("transformers", reason="the tests' extra holds transformers")
torch = pytest.importorskip("torch")

VOCAB = 32064  # above Phi-3's default pad_token_id, 32000
ABSENT = object()  # config.json without a pad_token_id key


def config_json(family: str, pad: object, tmp_path) -> dict:
    """A config.json of ``family`` (a key of ``FAMILY_CONFIGS``, or gpt2) as
    ``save_pretrained`` writes it, its pad_token_id ``pad`` (``ABSENT``: no such key)."""
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB,
                                         n_positions=16)
    else:
        name, settings = FAMILY_CONFIGS[family]
        config = getattr(transformers, name)(**{**TINY, "num_hidden_layers": 3,
                                                "num_key_value_heads": 2, **settings,
                                                "vocab_size": VOCAB})
    config.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.pop("pad_token_id", None)
    if pad is not ABSENT:
        hf["pad_token_id"] = pad
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return hf


def torch_padding_row(tmp_path) -> int | None:
    """The ``padding_idx`` of the embedding ``transformers`` builds from the config.json in
    ``tmp_path`` (on the meta device: no weights made)."""
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.get_input_embeddings().padding_idx


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", *sorted(FAMILY_CONFIGS)])
@pytest.mark.parametrize("pad", [ABSENT, None, 7, -1], ids=["absent", "null", "7", "-1"])
def test_each_family_holds_out_the_row_transformers_builds_with_padding_idx(family, pad,
                                                                             tmp_path):
    hf = config_json(family, pad, tmp_path)
    want = torch_padding_row(tmp_path)
    assert architecture(hf).fields["pad_id"] == want
    # the cases tell something apart: a family's default, a row counted from the end
    if family == "phi3" and pad is ABSENT:
        assert want == 32000
    if family != "gpt2" and pad == -1:
        assert want == VOCAB - 1


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_a_pad_token_id_outside_the_vocabulary_is_refused_as_torch_refuses_it(family,
                                                                              tmp_path):
    hf = config_json(family, VOCAB, tmp_path)
    with pytest.raises(WeightsError, match=rf"pad_token_id {VOCAB} is not a token of the "
                                           rf"vocabulary \(vocab_size {VOCAB}\)"):
        architecture(hf)
    with pytest.raises(AssertionError, match="Padding_idx"):
        torch_padding_row(tmp_path)


def test_a_pad_id_outside_the_vocabulary_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"model.pad_id=64 is not a token of the vocabulary "
                                         r"\(model.vocab=64\)"):
        TransformerModel(vocab=64, pad_id=64)


def embedding_gradients(path, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gradient of the mean next-token loss over ``tokens`` with respect to the embedding
    table, trainrun's (the model loaded from ``path``) and torch's."""
    loaded = trainrun.load(path)
    model = build_model(loaded.config)
    batch = {"tokens": jnp.asarray(tokens, jnp.int32)}
    grads = jax.grad(lambda p: model.loss(p, batch, None)[0])(
        jax.tree.map(jnp.asarray, loaded.params))
    ours = np.asarray(grads["embed"]["embedding"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.from_numpy(np.asarray(tokens, np.int64))
    hf(ids, labels=ids).loss.backward()
    return ours, hf.get_input_embeddings().weight.grad.numpy()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "pad", "tied"), [
    ("qwen3", 5, False), ("qwen3", 5, True),
    ("gemma3_text", ABSENT, False)])  # its default, 0; scaled embeddings
def test_the_embedding_gradient_is_torchs_with_no_lookup_gradient_in_the_pad_row(
        family, pad, tied, tmp_path):
    changes = {} if pad is ABSENT else {"pad_token_id": pad}
    path = save_tiny_family(tmp_path / family, family, tie_word_embeddings=tied, **changes)
    if pad is ABSENT:
        hf = json.loads((path / "config.json").read_text())
        del hf["pad_token_id"]
        (path / "config.json").write_text(json.dumps(hf))
    row = 0 if pad is ABSENT else pad
    tokens = np.random.default_rng(0).integers(1, 96, (2, 24))
    tokens[0, 5] = tokens[0, 11] = tokens[1, 17] = row  # inside the rows, read and predicted
    ours, theirs = embedding_gradients(path, tokens)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-6)
    assert trainrun.load(path).config.pad_id == row
    if tied:  # the head's gradient alone: as large as another row's
        assert np.abs(theirs[row]).max() > 0.1 * np.abs(theirs).max()
    else:
        assert not theirs[row].any() and not ours[row].any()
    assert np.abs(theirs).max() > 0.05


def test_an_export_writes_the_pad_row_and_reads_it_back(tmp_path):
    """A model's pad row is its config.json's pad_token_id (null where it has none, though the
    family's default is another), and reading the export gives the same row."""
    for pad in (None, 3):
        cfg = TransformerModel(vocab=64, d_model=16, layers=1, heads=2, seq_len=16,
                               mlp="swiglu", norm="rmsnorm", positions="rope",
                               fused_projections=True, tie_embeddings=False, pad_id=pad)
        params = jax.tree.map(np.asarray, build_model(cfg).init(jax.random.key(0)))
        out = tmp_path / f"pad-{pad}"
        write_model_dir(params, cfg, out, model_type="phi3")  # its default row: 32000
        hf = json.loads((out / "config.json").read_text())
        assert hf["pad_token_id"] == pad
        assert model_of(out).pad_id == pad


def test_an_export_keeps_a_row_counted_from_the_end_as_the_source_says_it(tmp_path):
    source = {**json.loads(json.dumps(TINY)), "model_type": "llama",
              "num_key_value_heads": 2, "pad_token_id": -1}
    cfg = TransformerModel.model_validate(architecture(source).fields)
    assert cfg.pad_id == TINY["vocab_size"] - 1
    params = jax.tree.map(np.asarray, build_model(cfg).init(jax.random.key(0)))
    write_model_dir(params, cfg, tmp_path, model_type="llama", source=source)
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] == -1
