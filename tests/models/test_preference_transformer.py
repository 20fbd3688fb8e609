"""The transformer's preference loss over packed pair rows: DPO's ln 2 at the start, the cached
reference and the in-step one giving the same numbers (full fine-tune and LoRA, whose reference
is the base with its adapters off), and accumulation giving the full batch's gradient."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun.config import LoraConfig, PreferenceConfig, TransformerModel
from trainrun.data.pair_rows import pack_pairs
from trainrun.data.preference_pairs import Pair
from trainrun.models.lora import adapters_off
from trainrun.models.preference_transformer import REFERENCE_COLUMN, make_preference_transformer
from trainrun.models.token_logps import pair_rows, token_logps
from trainrun.models.transformer import SharedPrefixes, bind_transformer
from trainrun.program.precision import Policy
from trainrun.program.step import make_gradient_fn

TINY = TransformerModel(d_model=32, layers=1, heads=2, seq_len=48, vocab=64, dropout=0.0)


def _rows(count: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    pairs = [Pair(*(rng.integers(1, 64, n).astype(np.uint32)
                    for n in (rng.integers(2, 6), rng.integers(1, 4), rng.integers(1, 4))))
             for _ in range(count)]
    rows, _ = pack_pairs(pairs, 49, bins=4)
    return rows


def _column(cfg: TransformerModel, params, rows: dict[str, np.ndarray]) -> np.ndarray:
    """The cached reference column of ``rows`` from ``params``, as the run stores it."""
    logps = np.asarray(jax.jit(lambda p, b: token_logps(bind_transformer(cfg)(p),
                                                        pair_rows(b))[0])(params, rows))
    return np.pad(logps, ((0, 0), (1, 0))).astype(np.float32).view(np.int32)


def _perturbed(params, seed: int = 1):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda p: p + 0.05 * jax.random.normal(next(keys), p.shape), params)


def test_the_first_step_of_dpo_has_loss_ln2() -> None:
    model = make_preference_transformer(TINY, PreferenceConfig())
    params = jax.jit(model.init)(jax.random.key(0))
    rows = _rows()
    batch = {**rows, REFERENCE_COLUMN: _column(TINY, params, rows)}
    loss, aux, _ = jax.jit(model.loss)(params, batch, jax.random.key(1))
    assert abs(float(loss) - math.log(2.0)) < 1e-6
    assert float(aux["weight"]) == 6.0  # the pairs, not the rows' slots
    assert abs(float(aux["rewards/margins"])) < 1e-6


@pytest.mark.slow
def test_cached_and_in_step_references_give_the_same_loss_and_gradient() -> None:
    cached = make_preference_transformer(TINY, PreferenceConfig(beta=0.5))
    in_step = make_preference_transformer(TINY, PreferenceConfig(beta=0.5, reference="in_step"))
    assert cached.init_model_state is None and in_step.init_model_state is not None
    start = jax.jit(cached.init)(jax.random.key(0))
    params = _perturbed(start)  # trained away from the start: the reference matters
    kept = {"params": start, "kept": jnp.ones((), jnp.bool_)}
    rows = _rows()
    batch = {**rows, REFERENCE_COLUMN: _column(TINY, start, rows)}
    loss_a, grads_a = jax.jit(jax.value_and_grad(
        lambda p: cached.loss(p, batch, jax.random.key(1))[0]))(params)
    loss_b, grads_b = jax.jit(jax.value_and_grad(
        lambda p: in_step.loss(p, rows, jax.random.key(1), kept)[0]))(params)
    assert float(loss_a) != pytest.approx(math.log(2.0), abs=1e-3)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads_a, grads_b)


@pytest.mark.slow
def test_the_in_step_reference_is_the_params_of_the_first_step_whatever_the_init() -> None:
    """A run from init.from starts with a model state drawn at random: the params it takes its
    first step with are the reference, from then on."""
    model = make_preference_transformer(TINY, PreferenceConfig(reference="in_step"))
    assert model.init_model_state is not None
    drawn = jax.jit(model.init_model_state)(jax.random.key(5))
    loaded = jax.jit(model.init)(jax.random.key(0))  # not what the model state holds
    rows = _rows()
    step = jax.jit(model.loss)
    loss, _, state = step(loaded, rows, jax.random.key(1), drawn)
    assert abs(float(loss) - math.log(2.0)) < 1e-6 and bool(state["kept"])
    jax.tree.map(np.testing.assert_array_equal, state["params"], loaded)
    moved = _perturbed(loaded)
    loss, aux, after = step(moved, rows, jax.random.key(1), state)
    jax.tree.map(np.testing.assert_array_equal, after["params"], loaded)
    assert abs(float(loss) - math.log(2.0)) > 1e-4 and float(aux["rewards/margins"]) != 0.0


@pytest.mark.slow
def test_lora_in_step_reference_is_the_base_with_its_adapters_off() -> None:
    cfg = TINY.model_copy(update={"lora": LoraConfig(rank=2, alpha=4, targets=("q", "v"))})
    model = make_preference_transformer(cfg, PreferenceConfig(reference="in_step"))
    assert model.init_model_state is None  # no second copy of the weights
    start = jax.jit(model.init)(jax.random.key(0))
    params = _perturbed(start)
    assert float(jnp.abs(params["blocks"]["0"]["attn"]["q_lora"]["b"]).sum()) > 0
    base = adapters_off(params)
    assert float(jnp.abs(base["blocks"]["0"]["attn"]["q_lora"]["b"]).sum()) == 0
    rows = _rows()
    cached = make_preference_transformer(cfg, PreferenceConfig())
    loss_in_step, aux, _ = jax.jit(model.loss)(params, rows, jax.random.key(1))
    loss_cached, _, _ = jax.jit(cached.loss)(
        params, {**rows, REFERENCE_COLUMN: _column(cfg, base, rows)}, jax.random.key(1))
    np.testing.assert_allclose(float(loss_in_step), float(loss_cached), rtol=1e-6)
    assert float(aux["rewards/margins"]) != 0.0


@pytest.mark.slow
def test_accumulated_microbatches_give_the_full_batch_gradient() -> None:
    model = make_preference_transformer(TINY, PreferenceConfig(reference="in_step"))
    start = jax.jit(model.init)(jax.random.key(0))
    params = _perturbed(start)
    kept = {"params": start, "kept": jnp.ones((), jnp.bool_)}
    rows = _rows(count=16, seed=0)
    rows = {name: value[:4] for name, value in rows.items()}
    assert len({int(row.max()) for row in rows["pair_slot"]}) > 1  # pairs per row differ
    whole = jax.jit(make_gradient_fn(model, Policy()))
    split = jax.jit(make_gradient_fn(model, Policy(), accumulate=2))
    loss_a, _, grads_a, _ = whole(params, rows, jax.random.key(1), None, kept)
    loss_b, _, grads_b, _ = split(params, rows, jax.random.key(1), None, kept)
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 grads_a, grads_b)


@pytest.mark.slow
def test_the_cached_reference_reaches_a_bfloat16_step_unrounded() -> None:
    """Floating batch leaves are cast to the compute dtype; the reference column is not: a
    change below bfloat16's resolution still moves the rewards."""
    model = make_preference_transformer(TINY, PreferenceConfig())
    params = jax.jit(model.init)(jax.random.key(0))
    rows = _rows()
    column = _column(TINY, params, rows)
    nudged = column.view(np.float32).copy()
    answer = np.argwhere(rows["answer"] > 0)[0]
    nudged[tuple(answer)] += 1e-4  # bfloat16 steps by 2**-5 at these values
    gradients = jax.jit(make_gradient_fn(model, Policy(compute=jnp.bfloat16)))
    rewards = []
    for reference in (column, nudged.view(np.int32)):
        aux = gradients(params, {**rows, REFERENCE_COLUMN: reference}, jax.random.key(1), None)[1]
        rewards.append(float(aux["rewards/chosen"]) + float(aux["rewards/rejected"]))
    assert rewards[0] != rewards[1]


def test_a_model_with_capped_logits_scores_pairs_through_its_cap() -> None:
    """Gemma 2's soft-capped output head: each token's log-probability is that of the capped
    logits ``cap * tanh(logits / cap)``."""
    cfg = TINY.model_copy(update={"final_logit_softcap": 0.01})
    params = jax.jit(make_preference_transformer(cfg, PreferenceConfig()).init)(
        jax.random.key(0))
    rows = _rows()

    def both(params, rows):
        module = bind_transformer(cfg)(params)
        tokens = rows["tokens"]
        prefixes = SharedPrefixes(rows["pair_slot"][:, :-1], rows["branch"][:, :-1],
                                  rows["positions"][:, :-1])
        features, _ = module.features(tokens[:, :-1], None, segments=prefixes,
                                      segment_positions=rows["positions"][:, :-1].astype(
                                          jnp.int32))
        raw = features @ module.head_table().T
        return token_logps(module, pair_rows(rows))[0], raw, tokens

    got, raw, tokens = jax.jit(both)(params, rows)
    logits = 0.01 * np.tanh(np.asarray(raw, np.float64) / 0.01)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.asarray(tokens[:, 1:]).reshape(-1, 1).astype(int),
                                axis=-1).reshape(got.shape)
    counted = np.asarray(got) != 0
    assert counted.sum() > 10
    np.testing.assert_allclose(np.asarray(got)[counted], picked[counted], rtol=0, atol=1e-6)


@pytest.mark.parametrize("reference", ["cached", "in_step"])
def test_the_rows_logits_are_held_a_chunk_at_a_time_with_the_same_loss(reference: str) -> None:
    from trainrun.program.precision import equations

    rows = _rows()
    # a vocabulary whose logits outweigh every other value of the step
    whole_cfg = TINY.model_copy(update={"loss_chunk": 0, "vocab": 1024})
    chunked_cfg = whole_cfg.model_copy(update={"loss_chunk": 16})  # 2 x 48 tokens: 6 chunks
    settings = PreferenceConfig(reference=reference)  # type: ignore[arg-type]
    params = jax.jit(make_preference_transformer(whole_cfg, settings).init)(jax.random.key(0))
    batch = {**rows, REFERENCE_COLUMN: _column(whole_cfg, params, rows)}
    policy = _perturbed(params)

    # in the step: the reference is the params the model state keeps
    start = None if reference == "cached" else {"params": params,
                                                "kept": jnp.ones((), jnp.bool_)}

    def grads_of(cfg):
        model = make_preference_transformer(cfg, settings)
        return lambda p: jax.grad(lambda q: model.loss(q, batch, None, start)[0])(p), model

    largest = {}
    for name, cfg in (("whole", whole_cfg), ("chunked", chunked_cfg)):
        grads, _ = grads_of(cfg)
        largest[name] = max(int(np.prod(v.aval.shape)) for e in equations(grads, policy)
                            for v in e.outvars if getattr(v.aval, "dtype", None) == jnp.float32)
    tokens = rows["tokens"].shape[0] * (rows["tokens"].shape[1] - 1)
    assert largest["whole"] >= tokens * 1024  # the control: every token's logits at once
    assert largest["chunked"] < tokens * 1024
    losses = [float(jax.jit(grads_of(cfg)[1].loss)(policy, batch, None, start)[0])
              for cfg in (whole_cfg, chunked_cfg)]
    assert abs(losses[0] - losses[1]) < 1e-6 and abs(losses[0] - math.log(2.0)) > 1e-3


@pytest.mark.parametrize("window", [None, 2, 3])
@pytest.mark.parametrize("backend", ["cpu", "gpu"])  # gpu: the XLA form with its mask
def test_each_branch_attends_to_the_shared_prefix_and_itself_alone(backend, window,
                                                                   monkeypatch) -> None:
    """A pair's rejected branch computes what its prompt and answer alone compute, within a
    sliding window of positions too, and nothing reaches it from the chosen branch beside it."""
    from trainrun.models import transformer

    monkeypatch.setattr(transformer.jax, "default_backend", lambda: backend)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 9, 2, 8)) for i in range(3))
    # prefix (3 tokens), chosen branch (3), rejected branch (2), padding (1)
    prefixes = SharedPrefixes(jnp.array([[1, 1, 1, 1, 1, 1, 1, 1, 0]]),
                              jnp.array([[0, 0, 0, 1, 1, 1, 2, 2, 0]]),
                              jnp.array([[0, 1, 2, 3, 4, 5, 3, 4, 0]]))

    def attention(q, k, v, segments=None):
        return transformer.causal_attention(q, k, v, segments, window=window)

    rejected = attention(q, k, v, prefixes)[0, 6:8]
    alone = [0, 1, 2, 6, 7]  # the prompt and the rejected answer: slots and positions agree
    plain = attention(q[:, alone], k[:, alone], v[:, alone])[0, 3:5]
    np.testing.assert_allclose(rejected, plain, rtol=1e-5, atol=1e-6)

    dk, dv = jax.grad(lambda k, v: attention(q, k, v, prefixes)[0, 6:8].sum(),
                      argnums=(0, 1))(k, v)
    assert not np.asarray(dk[0, 3:6]).any() and not np.asarray(dv[0, 3:6]).any()
    seen = 3 if window is None else window - 1  # prefix tokens the last one sees
    assert np.asarray(dv[0, 3 - seen:3]).all() and np.asarray(dv[0, 6:8]).all()
    assert not np.asarray(dv[0, :3 - seen]).any()
