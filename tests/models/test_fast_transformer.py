"""The transformer's fast CPU formulation computes the plain one's maths: the same loss (to 1e-5)
and gradients on fixed inputs as a direct transcription of the model. The default XLA flags
leave a flag the user chose alone and are in force in a process that imported trainrun; the
allocator setting leaves a user's malloc settings alone."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import llama_shaped

from trainrun.config import TransformerModel
from trainrun.models import build_model
from trainrun.models.reference import plain_loss
from trainrun.models.transformer import causal_attention
from trainrun.platform.process import apply_default_flags, reuse_freed_memory, run_cpu_calls_inline

# seq 160 is two full attention blocks and a partial third (blocks of 64 query rows)
SMALL = TransformerModel(d_model=32, layers=1, heads=2, seq_len=160, init_std=0.1)
BENCH = TransformerModel(d_model=256, layers=4, heads=4, seq_len=256)  # the benchmark's shape


def fixed_batch(cfg: TransformerModel, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, cfg.seq_len + 1))
    return {"tokens": tokens.astype(np.uint8)}


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["rope", "learned", "llama"])
def test_fast_transformer_has_the_plain_loss_and_gradients(positions):
    cfg = (llama_shaped(SMALL, kv_heads=1) if positions == "llama"
           else SMALL.model_copy(update={"positions": positions}))
    model = build_model(cfg)
    params = model.init(jax.random.key(0))
    batch = fixed_batch(cfg, 3)
    key = jax.random.key(1)  # dropout is 0: the key changes nothing
    fast_loss, fast_grads = jax.jit(jax.value_and_grad(
        lambda p: model.loss(p, batch, key)[0]))(params)
    loss, grads = jax.jit(jax.value_and_grad(lambda p: plain_loss(cfg, p, batch)))(params)
    assert abs(float(fast_loss) - float(loss)) < 1e-5
    assert float(loss) > 1.0  # a real loss, not a degenerate one
    for (path, fast), plain in zip(jax.tree_util.tree_leaves_with_path(fast_grads),
                                   jax.tree.leaves(grads), strict=True):
        scale = float(jnp.max(jnp.abs(plain)))
        assert scale > 0, path
        np.testing.assert_allclose(fast, plain, rtol=0, atol=1e-4 * scale, err_msg=str(path))


@pytest.mark.slow
def test_fast_transformer_has_the_plain_loss_at_the_benchmark_shape():
    model = build_model(BENCH)
    params = model.init(jax.random.key(0))
    batch = fixed_batch(BENCH, 2, seed=1)
    fast = jax.jit(lambda p: model.loss(p, batch, jax.random.key(0))[0])(params)
    plain = jax.jit(lambda p: plain_loss(BENCH, p, batch))(params)
    assert abs(float(fast) - float(plain)) < 1e-5
    assert abs(float(plain) - math.log(256)) < 0.1  # an untrained byte LM: near uniform


@pytest.mark.slow
@pytest.mark.parametrize("seq", [37, 200])  # under one block; three and a partial fourth
def test_blocked_causal_attention_is_dot_product_attention(seq):
    q, k, v, cotangent = (jnp.asarray(np.random.default_rng(i).standard_normal((2, seq, 3, 16)),
                                      jnp.float32) for i in range(4))

    @jax.jit
    def forward_and_pullback(q, k, v, cotangent):
        out, pullback = jax.vjp(causal_attention, q, k, v)
        reference, plain_pullback = jax.vjp(
            lambda *qkv: jax.nn.dot_product_attention(*qkv, is_causal=True), q, k, v)
        return out, reference, pullback(cotangent), plain_pullback(cotangent)

    out, reference, blocked, plain = forward_and_pullback(q, k, v, cotangent)
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-5)
    for got, want in zip(blocked, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("flags", "switch", "asked"), [
    ("--xla_gpu_deterministic_ops=true", "all", [None]),
    ("--xla_gpu_deterministic_ops=false", "all", ["cudnn", None]),
    ("--xla_gpu_deterministic_ops=false", "none", [None])])
def test_gpu_attention_is_cudnn_only_where_chosen_outside_deterministic_mode(
        monkeypatch, flags, switch, asked):
    """On a GPU in bfloat16, the attention chosen once (``Strategies.attention``) is cuDNN's
    fused attention only where XLA:GPU is not deterministic (trainrun's GPU default: there a
    program with two cuDNN attention calls fails when run) and ``fused_gpu_attention`` is on;
    attention itself reads no environment. Here, on CPU, cuDNN refuses and the XLA form
    answers."""
    from trainrun.fast import strategies

    implementations: list[str | None] = []
    real = jax.nn.dot_product_attention

    def spy(*args, implementation=None, **kwargs):
        implementations.append(implementation)
        return real(*args, implementation=implementation, **kwargs)

    jax.devices()  # the backend starts with the process's own flags, not the ones set here
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    path = strategies.chosen({"TRAINRUN_FAST_PATHS": switch}).attention({"XLA_FLAGS": flags})
    assert path.fused_gpu == (asked[0] == "cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true" if path.fused_gpu else
                       "--xla_gpu_deterministic_ops=false")  # read by no one from here on
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16), jnp.bfloat16)
    out = causal_attention(q, q, q, path=path)
    assert implementations == asked
    assert out.shape == q.shape


def test_score_programs_attend_in_larger_blocks_and_compute_the_same_scores(monkeypatch):
    """lm-eval's score programs (``cpu_score_compile``) attend in blocks of 256 query rows:
    at 300 positions two blocks' matmuls in the program where training's 64 make five, and
    the same log-probabilities and argmax flags."""
    from trainrun.evaluation.harness import _scorer
    from trainrun.fast import strategies

    cfg = SMALL.model_copy(update={"seq_len": 300})
    larger_blocks = strategies.chosen().score_attention()
    assert larger_blocks.block == 256
    monkeypatch.setenv("TRAINRUN_FAST_PATHS", "none")
    assert strategies.chosen().score_attention().block == 64
    params = build_model(cfg).init(jax.random.key(0))
    rows = fixed_batch(cfg, 2)["tokens"][:, :301].astype(np.int32)
    segments = np.ones((2, 300), np.int32)
    batch = (rows[:, :-1], rows[:, 1:], segments, np.broadcast_to(np.arange(300), (2, 300)))
    larger, training = _scorer(cfg, "float32", larger_blocks), _scorer(cfg, "float32")

    def matmuls(score) -> int:
        return str(jax.make_jaxpr(score)(params, *batch)).count("dot_general")

    assert matmuls(training) - matmuls(larger) == 2 * (5 - 2)  # logits and values per block
    (logp, greedy), (want, want_greedy) = larger(params, *batch), training(params, *batch)
    np.testing.assert_allclose(logp, want, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(greedy, want_greedy)


def test_a_static_rotary_table_is_one_small_program_with_the_op_by_op_bits():
    """Tracing a rotary model at a new static length compiles one program for its table (op
    by op it compiled six), and the table has the bits of the ops run one at a time and of the
    table a decoding step computes in its program."""
    from trainrun.evaluation.language_model import _forward
    from trainrun.models.transformer import Rope, _static_rope, rotary_frequencies

    compiled: list[str] = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name", ""))

    cfg = SMALL.model_copy(update={"positions": "rope", "seq_len": 173})
    params = jax.eval_shape(build_model(cfg).init, jax.random.key(0))
    jax.monitoring.register_event_duration_secs_listener(listen)
    _forward(cfg, "float32").lower(params, jax.ShapeDtypeStruct((2, 173), jnp.int32))
    assert len(compiled) == 1, compiled
    rotary = (16, 10_000.0, None)
    table = _static_rope(3, 173, rotary)
    with jax.ensure_compile_time_eval():
        op_by_op = Rope.at(3 + jnp.arange(173), rotary_frequencies(*rotary))
    in_program = jax.jit(lambda p: Rope.at(p + jnp.arange(173), rotary_frequencies(*rotary)))(3)
    for got in (op_by_op, in_program):
        assert all(np.asarray(a).tobytes() == b.tobytes() for a, b in zip(got, table,
                                                                            strict=True))


def test_default_xla_flags_respect_the_users_choice_and_are_in_force():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert apply_default_flags(environ) == ["--xla_cpu_experimental_ynn_fusion_type="]
    assert environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=2 "
                                    "--xla_cpu_experimental_ynn_fusion_type=")
    chosen = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"}
    assert apply_default_flags(chosen) == []
    assert chosen["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot"
    # This process imported trainrun before computing: XLA:CPU compiles without YNNPACK.
    x = jnp.ones((64, 64))
    assert "__ynn_fusion" not in jax.jit(lambda a: a @ a).lower(x).compile().as_text()


def test_the_allocator_setting_leaves_a_users_malloc_choice_alone():
    assert reuse_freed_memory({"MALLOC_ARENA_MAX": "4"}) is False
    assert reuse_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}) is False


def test_single_device_cpu_calls_run_inline_after_configure_process():
    # conftest.py calls trainrun.configure_process() before any test computes, as the CLI does.
    assert jax.config.read("jax_cpu_enable_async_dispatch") is False
    jnp.ones(2).block_until_ready()
    assert run_cpu_calls_inline() is False  # the backend has started: too late to change


@pytest.mark.slow  # the kernels run in Pallas' interpreter
def test_the_transformer_on_the_tpu_kernels_has_the_plain_loss_and_gradients():
    """Splash attention (interpreted here) and the head's chunks unrolled: the same loss and
    gradients as the plain paths, grouped key/value heads and packed rows in."""
    from trainrun.fast.tpu_attention import SplashAttention
    from trainrun.models.losses import HeadPath
    from trainrun.models.transformer import AttentionPath, make_transformer

    cfg = llama_shaped(TransformerModel(d_model=128, layers=1, heads=4, seq_len=128,
                                        vocab=300, init_std=0.1, loss_chunk=96), kv_heads=2)
    plain = make_transformer(cfg)
    fast = make_transformer(cfg, AttentionPath(kernel=SplashAttention(128, 128)),
                            HeadPath(unrolled=True))
    params = plain.init(jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, 300, (2, 129)).astype(np.int32)
    segments = np.ones((2, 129), np.int32)
    segments[0, 70:] = 2
    positions = np.concatenate([np.arange(70), np.arange(59)])[None].repeat(2, 0)
    packed = {"tokens": tokens, "segment_ids": segments, "positions": positions.astype(np.int32)}
    for batch in ({"tokens": tokens}, packed):
        def value(model, batch=batch):
            return jax.jit(jax.value_and_grad(lambda p: model.loss(p, batch, None)[0]))(params)

        (loss, grads), (want, want_grads) = value(fast), value(plain)
        assert float(want) > 1.0 and abs(float(loss) - float(want)) < 1e-5
        for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * float(jnp.max(jnp.abs(ref))))
