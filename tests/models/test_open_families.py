"""The families fine-tuned today beside Llama, Qwen2 and Mistral: Qwen3 (q/k norms), Gemma 3
(1 + w norms around each sublayer, scaled embeddings, local layers with their own rotary base
and a sliding window), Phi-3 (fused q/k/v and gate/up), Llama's bias options, sliding windows
in Mistral and Qwen2, and the mixtures of experts Mixtral, Qwen3-MoE (with a dense layer) and
Qwen2-MoE (with its gated shared expert), 8 experts top-2, Gemma 2 (Gemma's norms and scaled
embeddings, soft-capped attention and output logits, local layers every other one) and OLMo-2
(RMSNorm after each sublayer and none before, q/k norms over the whole projections). Each is a
random model saved in shards by `transformers`, every weight drawn: trainrun's logits are
`transformers`' within 1e-4, its greedy decoding of 200 tokens is `transformers`' `generate`
token for token (past the 128 positions `load` once capped the context at), and what trainrun
writes loads in `transformers` with trainrun's logits."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import (
    FAMILY_CONFIGS,
    MOE_CONFIGS,
    hf_greedy,
    hf_greedy_batch,
    hf_logits,
    save_tiny_family,
)

import trainrun
from trainrun.models.huggingface import INDEX, write_model_dir

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

FAMILIES = sorted(FAMILY_CONFIGS)
# A LoRA fine-tune end to end for each layout of adapters PEFT names differently: fused
# projections (phi3), Mixtral's experts, a shared expert (qwen2_moe), and the two families
# whose soft-caps and norms are newest. The dense Llama layout (llama, mistral, qwen2, qwen3,
# gemma3_text and their variants) goes to PEFT and back in test_peft.py and
# test_open_models.py, Qwen3-MoE's experts in test_peft.py.
LORA_FAMILIES = ["gemma2", "mixtral", "olmo2", "phi3", "qwen2_moe"]
TOKENS = np.random.default_rng(1).integers(0, 96, (2, 40))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("open-families")
    return {family: save_tiny_family(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_loads_with_the_logits_transformers_computes(family_dirs, family):
    path = family_dirs[family]
    assert (path / INDEX).is_file()  # saved in shards
    model = trainrun.load(path)
    cfg = model.config
    expected = {"qwen3": dict(qk_norm=True, attention_bias=True),
                "gemma3_text": dict(norm_plus_one=True, post_norms=True, embed_scale=True,
                                    mlp="geglu", sliding_window=8, sliding_layers=(0, 2),
                                    local_rope_theta=100.0, rope_theta=50000.0),
                "phi3": dict(sliding_window=12, sliding_layers=None),
                "llama_biases": dict(attention_bias=True, mlp_bias=True),
                "mistral_window": dict(sliding_window=6, sliding_layers=None),
                "qwen2_window": dict(sliding_window=7, sliding_layers=(1, 2), qkv_bias=True),
                "mixtral": dict(experts=8, experts_per_token=2, router_renormalise=True,
                                router_aux_loss=0.02),
                "qwen3_moe": dict(experts=8, expert_hidden=32, dense_layers=(1,),
                                  qk_norm=True, router_renormalise=True),
                "qwen2_moe": dict(experts=8, shared_expert_hidden=48, qkv_bias=True,
                                  router_renormalise=False),
                "gemma2": dict(norm_plus_one=True, post_norms=True, embed_scale=True,
                               mlp="geglu", sliding_window=8, sliding_layers=(0, 2),
                               query_scale=20 ** -0.5, attention_logit_softcap=2.0,
                               final_logit_softcap=3.0, qk_norm=False),
                "olmo2": dict(pre_norms=False, post_norms=True, qk_norm=True,
                              qk_norm_over="projection", norm_eps=1e-5, mlp="swiglu")}
    for field, value in expected[family].items():
        assert getattr(cfg, field) == value, field
    assert cfg.seq_len == 256  # the model's own context, not a cap
    want = hf_logits(path, TOKENS)
    assert float(np.abs(want).max()) > 0.5
    np.testing.assert_allclose(model(TOKENS), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("family", "change"), [
    ("mistral_window", {"sliding_window": 7}),
    ("gemma2", {"attention_logit_softcap": None}), ("gemma2", {"final_logit_softcap": None})])
def test_each_family_trait_changes_the_logits(family_dirs, family, change):
    """Without the sliding window (or with another window), or without a soft-cap, the logits
    differ, so the test above would catch a trait that is ignored."""
    model = trainrun.load(family_dirs[family])
    other = trainrun.LanguageModel(model.config.model_copy(update=change), model.params)
    assert not np.allclose(other(TOKENS), model(TOKENS), atol=1e-3)


def test_gemma2s_training_loss_is_transformers_loss_of_its_capped_logits(family_dirs):
    """The loss trainrun trains on (its chunked head, the cap inside) is transformers'."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from trainrun.models import build_model

    path = family_dirs["gemma2"]
    model = trainrun.load(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(TOKENS, np.int64))
        want = float(reference(ids, labels=ids).loss)
    cfg = model.config.model_copy(update={"loss_chunk": 32})  # chunks: the custom backward's
    loss = build_model(cfg).loss(model.params, {"tokens": np.asarray(TOKENS, np.int32)},
                                 None)[0]
    assert abs(float(loss) - want) < 1e-5  # the cap changes the logits: the trait test


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_of_200_tokens_is_transformers_generate(family_dirs, family):
    path = family_dirs[family]
    prompt = TOKENS[0, :16]
    want = hf_greedy(path, prompt, 200)
    got = trainrun.load(path).generate(prompt, 200)
    assert len(got) == len(want) == 216
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "mistral_window", "qwen3"])
def test_batched_greedy_decoding_is_transformers_generate_on_a_padded_batch(family_dirs,
                                                                            family):
    """Prompts of three lengths in one batch (left-padded: each row's positions and attention
    start at its own first token) answer as transformers' batched generate does."""
    prompts = [TOKENS[0, :5], TOKENS[1, :17], TOKENS[0, 9:20]]
    want = hf_greedy_batch(family_dirs[family], prompts, 24)
    got = trainrun.load(family_dirs[family]).generate_batch(prompts, 24)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]


@pytest.mark.parametrize("family", FAMILIES)
def test_written_params_load_back_in_transformers_with_the_same_logits(family_dirs, family,
                                                                       tmp_path):
    source = family_dirs[family]
    model = trainrun.load(source)
    params = jax.tree.map(lambda x: np.asarray(x) * 1.25, model.params)
    hf = json.loads((source / "config.json").read_text())
    out = write_model_dir(params, model.config, tmp_path / "out", model_type=hf["model_type"],
                          source=hf, shard_bytes=60_000)
    ours = trainrun.LanguageModel(model.config, params)(TOKENS)
    assert not np.allclose(ours, model(TOKENS), atol=1e-3)
    np.testing.assert_allclose(hf_logits(out, TOKENS), ours, rtol=0, atol=1e-4)
    assert trainrun.load(out).config == model.config


def test_what_gemma_asks_and_trainrun_does_not_compute_is_refused(tmp_path):
    from trainrun.checkpointing.init_from import model_of
    from trainrun.models.huggingface import WeightsError

    path = save_tiny_family(tmp_path / "capped", "gemma3_text", attn_logit_softcapping=2.0)
    with pytest.raises(WeightsError, match=r"attn_logit_softcapping=2\.0") as err:
        model_of(path)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_gemma3_with_capped_output_logits_loads_with_transformers_logits(tmp_path):
    path = save_tiny_family(tmp_path / "capped", "gemma3_text", final_logit_softcapping=3.0)
    model = trainrun.load(path)
    assert model.config.final_logit_softcap == 3.0
    np.testing.assert_allclose(model(TOKENS), hf_logits(path, TOKENS), rtol=0, atol=1e-4)
    hf = json.loads((path / "config.json").read_text())
    written = write_model_dir(model.params, model.config, tmp_path / "out",
                              model_type="gemma3_text", source=hf)
    assert json.loads((written / "config.json").read_text())["final_logit_softcapping"] == 3.0


def test_a_soft_capped_model_is_refused_as_a_family_without_caps(family_dirs):
    """Soft-caps have no key in a Llama config.json: a capped model exported as llama is
    refused on one line, not written as another model."""
    from trainrun.models.huggingface import WeightsError, config_json

    cfg = trainrun.load(family_dirs["llama_biases"]).config
    capped = cfg.model_copy(update={"final_logit_softcap": 30.0})
    assert config_json(cfg, "llama")["model_type"] == "llama"
    with pytest.raises(WeightsError, match=r"final_logit_softcap=30\.0") as err:
        config_json(capped, "llama")
    assert "\n" not in str(err.value)


def test_a_context_given_to_load_sizes_the_model(family_dirs):
    model = trainrun.load(family_dirs["qwen3"], context=64)
    assert model.config.seq_len == 64
    from trainrun.checkpointing.run_context import ContextRefused

    with pytest.raises(ContextRefused, match="context=1"):
        trainrun.load(family_dirs["qwen3"], context=1)


@pytest.fixture(scope="module")
def byte_vocab_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("byte-vocab-families")
    return {family: save_tiny_family(root / family, family, vocab_size=256)
            for family in LORA_FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", LORA_FAMILIES)
def test_a_lora_fine_tune_exports_adapters_peft_loads_with_trainruns_logits(byte_vocab_dirs,
                                                                             family, tmp_path):
    import io

    pytest.importorskip("peft")
    from conftest import hf_logits as logits_of

    from trainrun.checkpointing.init_from import resolved
    from trainrun.cli import main
    from trainrun.config import load_config
    from trainrun.training.loop import run

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 96)) * 40)
    config = resolved(load_config("finetune", [
        "steps=6", "steps_per_call=3", "checkpoint.every=0", "eval.every=0",
        "optimizer.lr=0.01", "optimizer.schedule.warmup=1",
        f"init.from={byte_vocab_dirs[family]}", f"data.paths=[{corpus}]", "data.seq_len=24",
        "data.batch_size=2", "model.lora={rank: 4, alpha: 8, targets: all-linear}"]))
    run(config, tmp_path / "run", out=io.StringIO())
    trained = trainrun.load(tmp_path / "run")
    base = trainrun.load(byte_vocab_dirs[family])
    tokens = TOKENS[:, :24]
    assert not np.allclose(trained(tokens), base(tokens), atol=1e-4)  # the adapters count
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "adapters")]) == 0
    np.testing.assert_allclose(logits_of(byte_vocab_dirs[family], tokens,
                                         adapters=tmp_path / "adapters"),
                               trained(tokens), rtol=0, atol=1e-4)
    np.testing.assert_allclose(trainrun.load(tmp_path / "adapters")(tokens), trained(tokens),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize(("targets", "named"), [("[q, v]", "q and v without k"),
                                                ("[o, up]", "up without gate")])
def test_adapters_phi3_cannot_export_are_refused_before_the_run(family_dirs, tmp_path,
                                                                targets, named, capsys):
    """Phi-3 fuses q, k and v (and gate and up) into one layer, which takes one adapter: some
    of them alone has no PEFT form, so the config is refused, exit 2, nothing written."""
    from trainrun.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 96)) * 40)
    code = main(["train", "--config", "finetune", "--run-dir", str(tmp_path / "run"),
                 f"init.from={family_dirs['phi3']}", f"data.paths=[{corpus}]",
                 "data.seq_len=24", f"model.lora={{rank: 4, targets: {targets}}}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"model.lora.targets names {named}" in lines[0] and "all-linear" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_the_training_loss_is_transformers_loss_with_its_router_term(family_dirs, family):
    """The loss trainrun trains on is transformers' with output_router_logits: the next-token
    loss plus router_aux_loss_coef times the load-balancing loss over every expert layer."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from trainrun.models import build_model

    path = family_dirs[family]
    model = trainrun.load(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.asarray(TOKENS, np.int64))
    with torch.no_grad():  # the router sees the inputs: every token but the last
        out = reference(ids[:, :-1], labels=ids[:, :-1], output_router_logits=True)
        full = reference(ids, labels=ids)
    assert float(out.aux_loss) > 0
    coefficient = reference.config.router_aux_loss_coef
    lm = build_model(model.config)
    loss, aux, _ = lm.loss(model.params, {"tokens": np.asarray(TOKENS, np.int32)},
                           jax.random.key(0), None)
    assert abs(float(aux["router_aux_loss"]) - float(out.aux_loss)) < 1e-5
    assert abs(float(loss) - (float(full.loss) + coefficient * float(out.aux_loss))) < 1e-5
    shares = [float(aux[f"expert_share/{e}"]) for e in range(8)]
    assert abs(sum(shares) - 1.0) < 1e-5 and max(shares) < 1.0
