"""Mixed precision: float32 masters, a compute dtype, and dynamic loss scaling for float16."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import llama_shaped

from trainrun.checkpointing.checkpoints import Checkpoints
from trainrun.config import (
    CNNModel,
    MLPModel,
    NNXMLPModel,
    OptimizerConfig,
    RegressionData,
    TransformerModel,
    load_config,
)
from trainrun.data import batch_iterator, build_dataset
from trainrun.data.synthetic import regression_arrays
from trainrun.models import build_model, from_functions
from trainrun.models.mlp import make_mlp
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import LossScale, Policy, matmuls, policy_from_config
from trainrun.program.state import abstract_state, init_state
from trainrun.program.step import global_norm, make_eval_step, make_train_step
from trainrun.reporting.provenance import provenance
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run


def final_loss(tmp_path, *overrides: str) -> float:
    run(load_config("mlp", list(overrides)), tmp_path, out=io.StringIO())
    return read_metrics(tmp_path / "metrics.jsonl")[-1]["loss"]


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> float:
    """The default run's final loss (float32 throughout)."""
    return final_loss(tmp_path_factory.mktemp("f32"))


@pytest.mark.slow
def test_bfloat16_compute_trains_the_mlp_to_within_10_percent_of_float32(tmp_path, f32):
    bf16 = final_loss(tmp_path, "precision.compute=bfloat16")
    assert bf16 != f32  # it really computed in another dtype
    assert abs(bf16 - f32) <= 0.1 * f32, (bf16, f32)


def dtype_probe(seen: dict[str, str]):
    """The MLP, recording the dtypes its loss is called with (at trace time)."""
    mlp = make_mlp(MLPModel())

    def loss(params, batch, key):
        seen["params"] = str(params["w1"].dtype)
        seen["x"] = str(batch["x"].dtype)
        return mlp.loss(params, batch, key)[:2]  # (loss, aux): a user's loss function

    return from_functions(mlp.init, loss)


@pytest.mark.parametrize(("compute", "stored"), [("bfloat16", "float32"),
                                                  ("float16", "bfloat16")])
def test_the_model_computes_in_the_compute_dtype_and_masters_keep_theirs(compute, stored):
    seen: dict[str, str] = {}
    model = dtype_probe(seen)
    optimizer = build_optimizer(OptimizerConfig(lr=0.01))
    policy = Policy(params=jnp.dtype(stored), compute=jnp.dtype(compute))
    state = init_state(model, optimizer, 0, policy)
    state, metrics = jax.jit(make_train_step(model, optimizer, policy=policy))(
        state, regression_arrays(RegressionData()))
    assert seen == {"params": compute, "x": compute}
    assert {str(p.dtype) for p in jax.tree.leaves(state.params)} == {stored}
    floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {str(x.dtype) for x in floats} == {stored}
    assert metrics["loss"].dtype == jnp.float32  # the output dtype
    assert np.isfinite(float(metrics["loss"])) and int(state.nonfinite_steps) == 0
    assert ("loss_scale" in metrics) == (compute == "float16")


def test_the_loss_scale_halves_on_overflow_and_grows_after_its_interval():
    policy = Policy(compute=jnp.float16, growth_interval=3, factor=2.0)
    state = LossScale.create(8.0)
    yes, no = jnp.asarray(True), jnp.asarray(False)
    history = []
    for finite in [yes, yes, yes, yes, no, yes, no, no, no, no]:
        state = policy.adjust(state, finite)
        history.append((float(state.scale), int(state.good_steps)))
    assert history == [(8, 1), (8, 2), (16, 0), (16, 1), (8, 0), (8, 1), (4, 0), (2, 0), (1, 0),
                       (1, 0)]  # never below 1
    big = LossScale(scale=jnp.float32(3e38), good_steps=jnp.int32(2))
    assert float(policy.adjust(big, yes).scale) == pytest.approx(3e38)  # no growth into inf
    assert Policy().adjust(state, no) is state  # no loss scaling without float16


@pytest.mark.slow
def test_an_overflowing_scaled_gradient_is_skipped_and_halves_the_scale():
    model = make_mlp(MLPModel())
    optimizer = build_optimizer(OptimizerConfig(lr=0.01))
    policy = Policy(compute=jnp.float16, loss_scale=2.0**17)  # 131072 is inf in float16
    step = jax.jit(make_train_step(model, optimizer, policy=policy))
    state = init_state(model, optimizer, 0, policy)
    batch = regression_arrays(RegressionData())
    after, metrics = step(state, batch)
    assert int(after.nonfinite_steps) == 1
    assert float(after.loss_scale.scale) == 2.0**16
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(after.params), jax.tree.leaves(state.params), strict=True))
    # The loss itself was finite: only the scaled backward pass overflowed.
    assert np.isfinite(float(metrics["loss"]))
    again, _ = step(after, batch)  # 65536 still overflows; 32768 then fits
    final, _ = step(again, batch)
    assert int(final.nonfinite_steps) == 2 and float(final.loss_scale.scale) == 2.0**15


def overflow_at(step: int, total: int):
    """Full batches; the one of ``step`` is scaled up until float16 overflows (inf loss)."""
    batch = regression_arrays(RegressionData())
    for s in range(1, total + 1):
        yield {k: v * 1000.0 for k, v in batch.items()} if s == step else batch


@pytest.mark.slow
def test_float16_survives_an_injected_overflow(tmp_path, f32):
    config = load_config("mlp", ["steps=200", "precision.compute=float16"])
    out = io.StringIO()
    run(config, tmp_path, data=overflow_at(5, 200), out=out)
    records = read_metrics(tmp_path / "metrics.jsonl")
    by_step = {r["step"]: r for r in records}
    assert by_step[5]["nonfinite_steps"] == by_step[4]["nonfinite_steps"] + 1  # skipped
    assert by_step[6]["loss_scale"] == by_step[5]["loss_scale"] / 2  # halved
    assert "step 5: loss or gradients not finite; update skipped" in out.getvalue()
    # Training went on: the float16 run ends near the float32 one.
    assert records[-1]["loss"] < records[0]["loss"] / 50
    assert abs(records[-1]["loss"] - f32) <= 0.1 * f32


@pytest.mark.slow
def test_dtypes_of_params_optimizer_state_and_loss_scale_survive_a_checkpoint(tmp_path):
    """bfloat16 stored params (so bfloat16 Adam moments), float16 compute (a float32 loss scale
    and int32 counters): saved by the run, restored through ``Checkpoints``, every leaf keeps
    its dtype and its value."""
    config = load_config("mlp", ["steps=6", "checkpoint.every=3", "precision.params=bfloat16",
                                 "precision.compute=float16",
                                 "precision.loss_scale_growth_interval=2"])
    run(config, tmp_path, out=io.StringIO())
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]

    model, policy = build_model(config.model), policy_from_config(config.precision)
    optimizer = build_optimizer(config.optimizer, config.steps)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          abstract_state(model, optimizer, config.seed, policy))
    checkpoints = Checkpoints(tmp_path / "checkpoints", config, provenance(config.digest()))
    try:
        restored = checkpoints.restore(target, batch_iterator(build_dataset(config.data, 0)),
                                       lambda meta: None)
    finally:
        checkpoints.close()
    assert restored.step == 6
    state = restored.state
    dtypes = {str(x.dtype) for x in jax.tree.leaves(state.params)}
    moments = {str(x.dtype) for x in jax.tree.leaves(state.opt_state)}
    assert dtypes == {"bfloat16"} and moments == {"bfloat16", "int32"}
    assert state.loss_scale.scale.dtype == jnp.float32
    assert state.loss_scale.good_steps.dtype == jnp.int32
    assert state.nonfinite_steps.dtype == state.step.dtype == jnp.int32
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), target)
    # The values read back too: the state gives the run's last metrics.
    assert int(state.nonfinite_steps) == last["nonfinite_steps"]
    assert float(global_norm(state.params)) == pytest.approx(last["param_norm"], rel=1e-6)


# ---- the compute dtype, checked on the program ----------------------------------------------

MODELS = {
    "mlp": (MLPModel(), lambda: regression_arrays(RegressionData())),
    "nnx_mlp": (NNXMLPModel(features=64, hidden=[32, 32], outputs=10, task="classification",
                            dropout=0.1),
                lambda: {"x": np.ones((4, 8, 8, 1), np.float32), "label": np.zeros(4, np.int32)}),
    "cnn": (CNNModel(channels=[8, 16], hidden=32, dropout=0.1),
            lambda: {"x": np.ones((4, 8, 8, 1), np.float32), "label": np.zeros(4, np.int32)}),
    "transformer": (TransformerModel(d_model=32, layers=2, heads=2, seq_len=16, vocab=64,
                                     dropout=0.1, loss_chunk=24),  # 4 x 16 tokens: 3 chunks
                    lambda: {"tokens": np.zeros((4, 17), np.int32)}),
    "transformer_llama": (  # RMSNorm, SwiGLU, GQA, rotary scaling, untied head, q/k/v biases
        llama_shaped(TransformerModel(d_model=32, layers=2, heads=4, seq_len=16, vocab=64,
                                      dropout=0.1), kv_heads=2),
        lambda: {"tokens": np.zeros((4, 17), np.int32)}),
    "transformer_learned_scan_remat": (
        TransformerModel(d_model=32, layers=2, heads=2, seq_len=16, vocab=64,
                         positions="learned", scan_layers=True, remat="full"),
        lambda: {"tokens": np.zeros((4, 17), np.int32)}),
}


def matmul_operand_dtypes(name: str, compute: str) -> tuple[list, list]:
    """The operand dtypes of every matmul/convolution in the train step's and the eval step's
    jaxprs for a built-in model under ``compute``."""
    cfg, batch = MODELS[name]
    model = build_model(cfg)
    optimizer = build_optimizer(OptimizerConfig(lr=0.01))
    policy = Policy(compute=jnp.dtype(compute))
    state = init_state(model, optimizer, 0, policy)
    train = matmuls(make_train_step(model, optimizer, policy=policy), state, batch())
    evaluate = matmuls(make_eval_step(model, policy), state.params, batch())
    return train, evaluate


# Matmuls allowed to take float32 operands under a half-precision policy. None: the loss's
# log-sum-exp, softmax and layer-norm statistics run in float32, but none of them is a matmul.
FLOAT32_MATMULS_ALLOWED: set[str] = set()


@pytest.mark.slow
@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_matmul_and_convolution_takes_the_compute_dtype(name, compute):
    train, evaluate = matmul_operand_dtypes(name, compute)
    assert len(train) > len(evaluate) > 0  # the backward pass's matmuls are in train
    if name == "cnn":
        assert any(m.primitive == "conv_general_dilated" for m in train)
    wrong = [m for m in train + evaluate
             if set(m.operands) != {compute} and m.where not in FLOAT32_MATMULS_ALLOWED]
    assert not wrong, wrong


def test_the_walk_sees_float32_matmuls_under_a_float32_policy_and_a_leaking_constant():
    train, _ = matmul_operand_dtypes("transformer", "float32")
    assert {m.operands for m in train} == {("float32", "float32")}
    # A user's model whose matmul escapes the cast through a float32 constant is caught.
    table = np.ones((8, 8), np.float32)
    leaky = from_functions(lambda key: {"w": jnp.ones((8, 1))},
                           lambda p, b, k: jnp.mean((b["x"] @ table @ p["w"]) ** 2))
    optimizer = build_optimizer(OptimizerConfig(lr=0.01))
    policy = Policy(compute=jnp.bfloat16)
    state = init_state(leaky, optimizer, 0, policy)
    found = matmuls(make_train_step(leaky, optimizer, policy=policy), state,
                    {"x": np.ones((4, 8), np.float32)})
    assert any("float32" in m.operands for m in found)
    assert all(m.where.startswith(__file__) for m in found)


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_sampling_runs_the_transformer_in_the_compute_dtype(compute):
    from trainrun.program.decode import decoder

    cfg = MODELS["transformer"][0]
    params = build_model(cfg).init(jax.random.key(0))
    decode = decoder(cfg, 2, 4, 6, compute, padded=True)
    found = matmuls(decode, params, jnp.zeros((2, 4), jnp.int32), jnp.array([0, 2], jnp.int32),
                    jnp.float32(1.0), jax.random.key(0), jnp.array([-1], jnp.int32))
    assert found and {m.operands for m in found} == {(compute, compute)}
