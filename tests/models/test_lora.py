"""Freezing and LoRA: only the adapters train, the base params stay bit for bit what they were
(weight decay included) with no optimizer state, and the merged export is base + scaled A·B."""

from __future__ import annotations

import io

import jax
import numpy as np
import pytest

from trainrun.checkpointing.reader import latest_params
from trainrun.cli import main
from trainrun.config import ConfigError, load_config
from trainrun.export import export_run
from trainrun.models import build_model
from trainrun.program.optim import build_optimizer, param_name
from trainrun.program.precision import policy_from_config
from trainrun.program.state import abstract_state, init_state
from trainrun.program.step import make_train_step
from trainrun.training.loop import run


def lora_config(tmp_path, *extra: str):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    return load_config("lm", [
        "steps=12", "steps_per_call=4", "checkpoint.every=0", "eval.every=0",
        "optimizer.schedule.warmup=2", "optimizer.lr=0.01", "optimizer.weight_decay=0.1",
        "model.d_model=32", "model.layers=2", "model.heads=2", "model.seq_len=32",
        "model.positions=learned", "model.bias=true",
        "model.lora={rank: 4, alpha: 8, targets: [q, v, up]}",
        f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=8", *extra])


def flat(params) -> dict[str, np.ndarray]:
    return {param_name(path): np.asarray(x)
            for path, x in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.slow
def test_lora_trains_only_the_adapters_and_exports_merged(tmp_path):
    config = lora_config(tmp_path)
    assert config.optimizer.trainable == [r"_lora\.(a|b)$"]  # the default with adapters
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 12)
    before = flat(init_state(model, optimizer, config.seed,
                             policy_from_config(config.precision)).params)
    run(config, tmp_path / "run", out=io.StringIO())
    _, trained = latest_params(tmp_path / "run", config)
    after = flat(trained)

    adapters = {n for n in after if "_lora." in n}
    assert len(adapters) == 2 * 3 * 2  # a and b, three targets, two layers
    for name, value in after.items():
        if name in adapters:
            if name.endswith(".b"):  # starts at zero; training moved it
                assert not np.array_equal(value, before[name]), name
        else:
            assert np.array_equal(value, before[name]), name  # bitwise, decay included
    # no optimizer state for frozen params: Adam's moments exist for the adapters only
    state = optimizer.tx.init(trained)
    moments = [x for x in jax.tree.leaves(state) if np.ndim(x) >= 1]
    assert len(moments) == 2 * len(adapters)

    # without --merge: the adapters alone, as PEFT's adapter directory
    done = export_run(tmp_path / "run", tmp_path / "adapters")
    assert set(done.files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "export"),
                 "--merge"]) == 0
    out = tmp_path / "export"
    from safetensors.numpy import load_file

    tensors = load_file(str(out / "model.safetensors"))
    scale = 8 / 4
    up = after["blocks.1.mlp.up.kernel"] + scale * (after["blocks.1.mlp.up_lora.a"]
                                                   @ after["blocks.1.mlp.up_lora.b"])
    np.testing.assert_allclose(tensors["transformer.h.1.mlp.c_fc.weight"], up, rtol=0,
                               atol=1e-6)
    q = after["blocks.0.attn.q.kernel"] + scale * (after["blocks.0.attn.q_lora.a"]
                                                  @ after["blocks.0.attn.q_lora.b"])
    np.testing.assert_allclose(tensors["transformer.h.0.attn.c_attn.weight"][:, :32], q,
                               rtol=0, atol=1e-6)
    assert not np.allclose(q, after["blocks.0.attn.q.kernel"])  # the adapters did something
    np.testing.assert_array_equal(tensors["transformer.h.0.attn.c_attn.weight"][:, 32:64],
                                  after["blocks.0.attn.k.kernel"])  # untargeted: as trained


def test_trainable_patterns_freeze_the_rest_and_one_matching_nothing_is_refused():
    config = load_config("mlp", ["optimizer.trainable=[w2, b2]"])
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer)
    params = model.init(jax.random.key(0))
    grads = jax.tree.map(np.ones_like, params)
    updates, _ = optimizer.tx.update(grads, optimizer.tx.init(params), params)
    moved = {name for name, u in flat(updates).items() if np.any(u != 0)}
    assert moved == {"w2", "b2"}
    nothing = build_optimizer(load_config("mlp", ["optimizer.trainable=[nope]"]).optimizer)
    with pytest.raises(ConfigError, match="matches no param"):
        nothing.tx.init(params)
    with pytest.raises(ConfigError, match="not a regular expression"):
        load_config("mlp", ["optimizer.trainable=['(']"])


def count_primitive(jaxpr, name: str) -> int:
    """Equations of primitive ``name`` in ``jaxpr`` and the jaxprs nested in it (scans, jits)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += count_primitive(inner, name)
    return count


def test_lora_step_computes_no_gradient_for_the_frozen_kernels(tmp_path):
    def matmuls(*extra: str) -> int:
        config = lora_config(tmp_path, *extra)
        model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 12)
        state = abstract_state(model, optimizer, config.seed, policy_from_config(config.precision))
        batch = {"tokens": jax.ShapeDtypeStruct((8, 33), np.uint8)}
        return count_primitive(jax.make_jaxpr(make_train_step(model, optimizer))(
            state, batch).jaxpr, "dot_general")

    # Every param trainable against only the adapters: the backward pass drops at least one
    # matmul (the weight gradient) per frozen kernel: q, k, v, o, up, down in each of 2 layers.
    assert matmuls("optimizer.trainable=[.]") - matmuls() >= 6 * 2


LLAMA_LAYOUT = ["model.positions=rope", "model.mlp=swiglu", "model.norm=rmsnorm",
                "model.bias=false", "model.tie_embeddings=false", "model.kv_heads=1"]


def forward_matmuls(tmp_path, *extra: str) -> int:
    config = lora_config(tmp_path, *LLAMA_LAYOUT, *extra)
    model = build_model(config.model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    batch = {"tokens": jax.ShapeDtypeStruct((8, 33), np.uint8)}
    return count_primitive(jax.make_jaxpr(model.eval_loss)(params, batch).jaxpr, "dot_general")


def test_adapters_that_read_one_input_apply_their_a_matrices_in_one_matmul(tmp_path):
    # q, k and v read the same rows, as gate and up do: one matmul for their three (two) A
    # matrices, then each B. Per block: q,k,v 1 + 3, o 2, gate,up 1 + 2, down 2 = 11, where an
    # adapter at a time makes 14; on a 64-wide model the step is bound by its op count.
    base = forward_matmuls(tmp_path, "model.lora=null")
    every = forward_matmuls(tmp_path, "model.lora={rank: 4, targets: all-linear}")
    assert every - base == 11 * 2
    # alone, an adapter is its two matmuls: q and v read the same rows, o does not
    assert forward_matmuls(tmp_path, "model.lora={rank: 4, targets: [q, v]}") - base == 3 * 2
    assert forward_matmuls(tmp_path, "model.lora={rank: 4, targets: [q, o]}") - base == 4 * 2


def test_adapters_applied_together_compute_each_adapter_alone(tmp_path):
    """x·W + s·(x·A)·B of each layer: the A matrices in one matmul give what each adapter
    applied alone gives, with the adapters' B non-zero (a fresh B is zero)."""
    from trainrun.models import transformer

    config = lora_config(tmp_path, *LLAMA_LAYOUT, "model.lora={rank: 4, alpha: 6, "
                         "targets: all-linear}")
    model = build_model(config.model)
    params = model.init(jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [leaf + 0.05 * jax.random.normal(key, leaf.shape)
                                       for leaf, key in zip(leaves, keys, strict=True)])
    batch = {"tokens": np.arange(8 * 33).reshape(8, 33).astype(np.uint8) % 200}
    together = model.eval_loss(params, batch)[0]
    alone = transformer._project_each
    try:
        transformer._project_each = lambda pairs, x: [transformer._project(layer, adapter, x)
                                                      for layer, adapter in pairs]
        separately = model.eval_loss(params, batch)[0]
    finally:
        transformer._project_each = alone
    assert abs(float(together) - float(separately)) < 1e-6 * abs(float(separately))


def test_fresh_adapters_leave_the_base_init_alone_and_draw_a_at_its_scale(tmp_path):
    """The adapters are drawn off a stream of their own: a LoRA model's base params are the
    plain model's init, bit for bit. Each A ~ N(0, 1/d_in), no two alike; each B is zero."""
    config = lora_config(tmp_path, *LLAMA_LAYOUT, "model.lora={rank: 8, targets: all-linear}",
                         "model.d_model=64", "model.layers=3")
    plain = flat(build_model(config.model.model_copy(update={"lora": None})).init(
        jax.random.key(5)))
    adapted = flat(build_model(config.model).init(jax.random.key(5)))
    assert plain and all(adapted[name].tobytes() == value.tobytes()
                         for name, value in plain.items())
    a = {name: value for name, value in adapted.items() if name.endswith("_lora.a")}
    b = [value for name, value in adapted.items() if name.endswith("_lora.b")]
    assert len(a) == len(b) == 7 * 3 and not any(value.any() for value in b)
    assert len({value.tobytes() for value in a.values()}) == len(a)
    for d_in in {value.shape[0] for value in a.values()}:  # 64 (six layers) and the MLP's
        pooled = np.concatenate([v.ravel() for v in a.values() if v.shape[0] == d_in])
        assert abs(pooled.mean()) < 4 / np.sqrt(pooled.size * d_in)
        assert abs(pooled.std() * np.sqrt(d_in) - 1) < 0.05, (d_in, pooled.std())


def test_the_adapters_draw_does_not_grow_with_the_layers(tmp_path):
    """A fine-tune from a model directory draws its adapters alone: one sampler for all of
    them, however deep the model (one per adapter made its compile grow with the depth)."""
    from trainrun.models.transformer import adapter_draws

    def samplers(layers: int) -> int:
        config = lora_config(tmp_path, *LLAMA_LAYOUT, f"model.layers={layers}",
                             "model.lora={rank: 4, targets: all-linear}")
        abstract = jax.eval_shape(build_model(config.model).init, jax.random.key(0))
        shapes = {name[:-2]: tuple(x.shape) for name, x in flat_shapes(abstract).items()
                  if name.endswith("_lora.a")}
        assert len(shapes) == 7 * layers
        jaxpr = jax.make_jaxpr(lambda: adapter_draws(jax.random.key(0), shapes))()
        return str(jaxpr).count("random_bits")

    assert samplers(2) == samplers(12) == 1


def flat_shapes(params) -> dict[str, jax.ShapeDtypeStruct]:
    return {param_name(path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}


def test_each_experts_adapter_a_is_drawn_at_its_d_in_scale():
    """An expert layer's ``a`` ``[experts, d_in, rank]`` is drawn ~ N(0, 1/d_in), as a plain
    layer's ``[d_in, rank]``."""
    from trainrun.models.transformer import adapter_draws, split_adapters

    shapes = {"blocks.0.mlp.down_lora": (8, 96, 8), "blocks.0.mlp.gate_lora": (8, 16, 8)}
    drawn = split_adapters(np.asarray(adapter_draws(jax.random.key(0), shapes)), shapes)
    for name, shape in shapes.items():
        assert drawn[name].shape == shape
        assert abs(drawn[name].std() * np.sqrt(shape[1]) - 1) < 0.05, name


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["model.mlp=swiglu", "model.experts=4", "model.expert_hidden=24", "model.dense_layers=[1]"],
    ["model.fused_projections=true", "model.kv_heads=1"],
])
def test_merged_adapters_of_experts_router_and_fused_layers_compute_the_adapted_model(
        tmp_path, layout):
    """``export --merge``'s weights: each expert's ``W + s A B``, the router's, and a fused
    adapter's ``s A B`` split over the layers it spans give the adapted model's loss."""
    from trainrun.models.transformer import merge_adapters

    config = lora_config(tmp_path, *LLAMA_LAYOUT, *layout,
                         "model.lora={rank: 3, alpha: 6, targets: all-linear}")
    model = build_model(config.model)
    params = model.init(jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [leaf + 0.2 * jax.random.normal(key, leaf.shape)
                                       for leaf, key in zip(leaves, keys, strict=True)])
    batch = {"tokens": np.arange(4 * 33).reshape(4, 33).astype(np.uint8) % 200}
    adapted = float(jax.jit(model.eval_loss)(params, batch)[0])
    names = flat(params)
    assert any(n.endswith(("mlp.gate_lora.a", "attn.qkv_lora.a")) and v.ndim >= 2
               for n, v in names.items())
    cfg, merged = merge_adapters(config.model, jax.tree.map(np.asarray, params))
    assert cfg.lora is None and not any("_lora" in n for n in flat(merged))
    plain = jax.jit(build_model(cfg).eval_loss)
    assert abs(float(plain(merged, batch)[0]) - adapted) < 1e-5 * adapted
    dropped = {**params, "blocks": {
        i: {part: {n: v for n, v in layers.items() if not n.endswith("_lora")}
            for part, layers in block.items()} for i, block in params["blocks"].items()}}
    assert abs(float(plain(dropped, batch)[0]) - adapted) > 1e-3  # the adapters count
