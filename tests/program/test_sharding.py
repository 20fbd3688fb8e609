"""Sharding: the mesh from config, the param and batch rules, and runs on 4 simulated devices
that agree with 1 device (data parallel) and with each other (FSDP, tensor parallel)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cli_env, run_cli
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from trainrun.cli import main
from trainrun.config import MeshConfig, MLPModel, OptimizerConfig, TransformerModel
from trainrun.models import build_model
from trainrun.program import sharding
from trainrun.program.optim import build_optimizer
from trainrun.program.state import abstract_state
from trainrun.reporting.sinks.jsonl import read_metrics


def abstract_mesh(data: int, fsdp: int, tensor: int, expert: int = 1) -> AbstractMesh:
    return AbstractMesh((data, fsdp, expert, tensor), sharding.AXES,
                        axis_types=(AxisType.Auto,) * 4)


# ---- the mesh --------------------------------------------------------------------------------


def test_mesh_defaults_to_data_parallel_over_every_device():
    assert sharding.mesh_shape(MeshConfig(), 8) == {"data": 8, "fsdp": 1, "expert": 1,
                                                    "tensor": 1}
    assert sharding.mesh_shape(MeshConfig(fsdp=2, tensor=2), 8) == {
        "data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert sharding.mesh_shape(MeshConfig(data=2, fsdp=-1), 8) == {
        "data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    assert sharding.mesh_shape(MeshConfig(expert=4), 8) == {
        "data": 2, "fsdp": 1, "expert": 4, "tensor": 1}


@pytest.mark.parametrize(("mesh", "devices", "message"), [
    (MeshConfig(fsdp=3), 8, "fsdp=3 x tensor=1 = 3 devices does not divide the 8"),
    (MeshConfig(data=2, fsdp=2, tensor=1), 8, "= 4 devices, but this run has 8"),
    (MeshConfig(data=-1, fsdp=-1), 8, "mesh axes data and fsdp are both -1"),
])
def test_bad_mesh_is_a_clear_error(mesh, devices, message):
    with pytest.raises(sharding.MeshError, match=message):
        sharding.mesh_shape(mesh, devices)


# ---- the rules -------------------------------------------------------------------------------


def spec(shape, names, data=1, fsdp=1, tensor=1, **cfg):
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    return sharding.param_spec(shape, names, sizes, MeshConfig(**cfg))


def test_tensor_parallel_splits_column_then_row_by_name():
    # An MLP pair: (embed, mlp) splits its output dim, (mlp, embed) its input dim.
    assert spec((64, 256), ("embed", "mlp"), tensor=4) == P(None, "tensor")
    assert spec((256, 64), ("mlp", "embed"), tensor=4) == P("tensor", None)
    assert spec((64, 64), ("embed", "heads"), tensor=4) == P(None, "tensor")
    assert spec((64,), ("embed",), tensor=4) == P(None)  # not a split name: whole
    assert spec((64, 6), ("embed", "mlp"), tensor=4) == P(None, None)  # 6 does not divide


def test_fsdp_shards_the_largest_divisible_dim_of_large_params():
    assert spec((512, 1024), None, fsdp=4, fsdp_min_size=0) == P(None, "fsdp")
    assert spec((1024, 6), None, fsdp=4, fsdp_min_size=0) == P("fsdp", None)
    assert spec((1026, 8), None, fsdp=4, fsdp_min_size=0) == P(None, "fsdp")  # 1026 % 4 != 0
    assert spec((6, 10), None, fsdp=4, fsdp_min_size=0) == P(None, None)  # nothing divides
    assert spec((512, 1024), None, fsdp=4, fsdp_min_size=10**6) == P(None, None)  # small
    # With tensor on the output dim, fsdp takes the largest remaining one.
    assert spec((64, 256), ("embed", "mlp"), fsdp=4, tensor=2, fsdp_min_size=0) == P(
        "fsdp", "tensor")


def test_logical_axes_must_name_every_dim():
    with pytest.raises(sharding.MeshError, match=r"\['w'\] has shape \(4, 8\) but its logical"):
        sharding.param_spec((4, 8), ("embed",), {"data": 1, "fsdp": 1, "tensor": 2},
                            MeshConfig(), "['w']")


def test_optimizer_state_follows_its_params():
    model = build_model(MLPModel(hidden=[32, 32]))
    optimizer = build_optimizer(OptimizerConfig(name="adam"), 10)
    state = abstract_state(model, optimizer, seed=0)
    shardings = sharding.state_shardings(abstract_mesh(2, 4, 2), state, model.logical_axes,
                                         optimizer.tx, MeshConfig(fsdp_min_size=0))
    params = jax.tree.map(lambda s: s.spec, shardings.params)
    assert params["w1"] == P("fsdp", "tensor") and params["w2"] == P("tensor", "fsdp")
    adam = shardings.opt_state[0]
    assert jax.tree.map(lambda s: s.spec, adam.mu) == params
    assert jax.tree.map(lambda s: s.spec, adam.nu) == params
    assert adam.count.spec == P() and shardings.step.spec == P()


def test_transformer_tensor_rules_split_attention_and_mlp():
    model = build_model(TransformerModel(vocab=64, d_model=32, layers=1, heads=4, seq_len=16))
    optimizer = build_optimizer(OptimizerConfig(), 10)
    state = abstract_state(model, optimizer, seed=0)
    shardings = sharding.state_shardings(abstract_mesh(1, 1, 2), state, model.logical_axes,
                                         optimizer.tx, MeshConfig())
    block = jax.tree.map(lambda s: s.spec, shardings.params["blocks"]["0"])
    assert block["attn"]["q"]["kernel"] == P(None, "tensor")  # column
    assert block["attn"]["o"]["kernel"] == P("tensor", None)  # row
    assert block["mlp"]["up"]["kernel"] == P(None, "tensor")
    assert block["mlp"]["down"]["kernel"] == P("tensor", None)
    assert block["ln1"]["scale"] == P(None)


def test_tensor_axis_without_logical_names_is_refused():
    model = build_model(MLPModel())
    model = type(model)(init=model.init, loss=model.loss, name="plain")
    optimizer = build_optimizer(OptimizerConfig(), 10)
    state = abstract_state(model, optimizer, seed=0)
    with pytest.raises(sharding.MeshError, match=r"mesh\.tensor=2 but the model names no param"):
        sharding.state_shardings(abstract_mesh(2, 1, 2), state, None, optimizer.tx,
                                 MeshConfig())


# ---- on simulated devices (subprocesses: each its own device count) --------------------------

MLP2 = ["model.hidden=[32]", "data.examples=512", "data.batch_size=64", "data.shuffle=true",
        "steps=50", "metrics.every=50", "metrics.tensorboard=false"]


def losses(run_dir) -> np.ndarray:
    return np.array([r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")], np.float64)


def train(run_dir, devices, *overrides):
    done = run_cli("train", "--run-dir", str(run_dir), *MLP2, *overrides, devices=devices)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(run_dir)


@pytest.mark.slow
def test_data_parallel_on_4_devices_matches_1_device(tmp_path):
    one = train(tmp_path / "one", 1)
    four = train(tmp_path / "four", 4)
    assert len(one) == 50
    np.testing.assert_allclose(four, one, rtol=1e-6, atol=0)
    assert one[-1] < one[0] / 10  # and it trains


SHARDED_RUNS = textwrap.dedent("""
    import io, json, sys
    from pathlib import Path
    import jax
    from trainrun.program import sharding
    from trainrun.config import load_config
    from trainrun.training.loop import run
    from trainrun.program.state import abstract_state, init_state
    from trainrun.models import build_model
    from trainrun.program.optim import build_optimizer
    from trainrun.reporting.sinks.jsonl import read_metrics

    name, base, root = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    arrays = sys.argv[4] == "arrays"
    meshes = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {
        "dp": [], "fsdp": ["mesh.data=1", "mesh.fsdp=4", "mesh.fsdp_min_size=0"],
        "dp_tp": ["mesh.data=2", "mesh.tensor=2"]}
    out = {}
    for mesh_name, mesh in meshes.items():
        config = load_config(name, base + mesh)
        run(config, root / mesh_name, out=io.StringIO())
        losses = [r["loss"] for r in read_metrics(root / mesh_name / "metrics.jsonl")]
        # What each device holds of each param: of the state as the run creates it (arrays), or
        # as its shardings say (cheaper: no second init).
        model, opt = build_model(config.model), build_optimizer(config.optimizer, config.steps)
        abstract = abstract_state(model, opt, config.seed)
        shardings = sharding.state_shardings(sharding.build_mesh(config.mesh), abstract,
                                             model.logical_axes, opt.tx, config.mesh)
        if arrays:
            state = init_state(model, opt, config.seed, shardings=shardings)
            shard = lambda leaf, _: leaf.addressable_shards[0].data.shape
        else:
            state = abstract
            shard = lambda leaf, where: where.shard_shape(leaf.shape)
        held = lambda tree, where: {
            jax.tree_util.keystr(path): [list(leaf.shape), list(shard(leaf, s))]
            for (path, leaf), s in zip(jax.tree.leaves_with_path(tree), jax.tree.leaves(where))}
        adam = lambda t: next(s for s in jax.tree.leaves(t, is_leaf=lambda s: hasattr(s, "mu"))
                              if hasattr(s, "mu")).mu
        out[mesh_name] = {"losses": losses, "params": held(state.params, shardings.params),
                          "mu": held(adam(state.opt_state), adam(shardings.opt_state))}
    print(json.dumps(out))
""")


def sharded_runs(tmp_path, config: str, base: list[str], arrays: bool,
                 meshes: dict[str, list[str]] | None = None, devices: int = 4) -> dict:
    """One process with ``devices`` devices trains ``config`` on each of ``meshes`` (default:
    data parallel, FSDP(4) and data 2 x tensor 2), and reports each run's losses and the shard
    shapes of its fresh state (from the arrays themselves, or from their shardings)."""
    extra = [] if meshes is None else [json.dumps(meshes)]
    done = subprocess.run([sys.executable, "-c", SHARDED_RUNS, config, json.dumps(base),
                           str(tmp_path), "arrays" if arrays else "shardings", *extra],
                          capture_output=True, text=True, timeout=600, env=cli_env(devices))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_match_data_parallel_on_the_mlp(tmp_path):
    out = sharded_runs(tmp_path, "mlp", MLP2, arrays=True)
    dp = out["dp"]["losses"]
    np.testing.assert_allclose(out["fsdp"]["losses"], dp, rtol=1e-5, atol=0)
    np.testing.assert_allclose(out["dp_tp"]["losses"], dp, rtol=1e-5, atol=0)
    # Really sharded: each device holds a quarter (fsdp) or half (tensor) of a param.
    assert out["fsdp"]["params"]["['w1']"] == [[8, 32], [8, 8]]
    assert out["fsdp"]["mu"]["['w1']"] == [[8, 32], [8, 8]]  # Adam's moments follow
    assert out["dp_tp"]["params"]["['w1']"] == [[8, 32], [8, 16]]  # column split
    assert out["dp_tp"]["params"]["['w2']"] == [[32, 1], [16, 1]]  # row split
    assert out["dp"]["params"]["['w1']"] == [[8, 32], [8, 32]]  # data parallel: replicated


@pytest.mark.slow
def test_fsdp_and_tensor_parallel_match_data_parallel_on_the_transformer(tmp_path):
    corpus = Path(json.__file__).parent / "*.py"  # the stdlib's json package: ~40 KB of text
    lm = ["model.d_model=32", "model.layers=2", "model.heads=4", "model.seq_len=16",
          "data.seq_len=16", "data.batch_size=8", f"data.paths=[{corpus}]",
          "data.prefetch_threads=0", "steps=10", "steps_per_call=5", "eval.every=0",
          "optimizer.schedule.warmup=2", "metrics.tensorboard=false"]
    out = sharded_runs(tmp_path, "lm", lm, arrays=False)
    dp = out["dp"]["losses"]
    assert len(dp) == 10 and dp[-1] < dp[0]
    np.testing.assert_allclose(out["fsdp"]["losses"], dp, rtol=1e-5, atol=0)
    np.testing.assert_allclose(out["dp_tp"]["losses"], dp, rtol=1e-5, atol=0)
    q = "['blocks']['0']['attn']['q']['kernel']"
    o = "['blocks']['0']['attn']['o']['kernel']"
    assert out["dp_tp"]["params"][q] == [[32, 32], [32, 16]]  # heads split: column
    assert out["dp_tp"]["params"][o] == [[32, 32], [16, 32]]  # then row
    assert out["fsdp"]["params"][q] == [[32, 32], [8, 32]]
    assert out["fsdp"]["mu"][q] == [[32, 32], [8, 32]]


@pytest.mark.slow
def test_expert_parallel_matches_one_device_alone_and_with_fsdp(tmp_path):
    """Every param trains, the experts' LoRA adapters (split over the devices with their
    experts) beside the experts' own weights."""
    corpus = Path(json.__file__).parent / "*.py"
    moe = ["model.d_model=32", "model.layers=1", "model.heads=4", "model.seq_len=16",
           "model.mlp=swiglu", "model.experts=8", "model.experts_per_token=2",
           "model.expert_hidden=64", "model.lora={rank: 2, targets: all-linear}",
           "optimizer.trainable=[.]", "data.seq_len=16", "data.batch_size=8",
           f"data.paths=[{corpus}]", "data.prefetch_threads=0", "steps=10", "steps_per_call=5",
           "eval.every=0", "optimizer.schedule.warmup=2", "metrics.tensorboard=false",
           "mesh.fsdp_min_size=0"]
    one = sharded_runs(tmp_path / "one", "lm", moe, arrays=False, meshes={"one": []},
                       devices=1)["one"]
    out = sharded_runs(tmp_path / "four", "lm", moe, arrays=False, meshes={
        "ep": ["mesh.data=1", "mesh.expert=4"],
        "fsdp_ep": ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2"]})
    assert len(one["losses"]) == 10 and one["losses"][-1] < one["losses"][0]
    np.testing.assert_allclose(out["ep"]["losses"], one["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(out["fsdp_ep"]["losses"], one["losses"], rtol=1e-5, atol=0)
    gate = "['blocks']['0']['mlp']['gate']"
    assert one["params"][gate] == [[8, 32, 64], [8, 32, 64]]
    assert out["ep"]["params"][gate] == [[8, 32, 64], [2, 32, 64]]  # 2 experts a device
    assert out["ep"]["mu"][gate] == [[8, 32, 64], [2, 32, 64]]
    assert out["fsdp_ep"]["params"][gate] == [[8, 32, 64], [4, 32, 32]]  # and FSDP within
    gate_b = "['blocks']['0']['mlp']['gate_lora']['b']"
    assert out["ep"]["params"][gate_b] == [[8, 2, 64], [2, 2, 64]]  # with their experts


def test_experts_the_expert_axis_does_not_divide_are_refused():
    model = build_model(TransformerModel(vocab=16, d_model=8, layers=1, heads=2, seq_len=4,
                                         mlp="swiglu", experts=6, expert_hidden=8))
    optimizer = build_optimizer(OptimizerConfig(), 10)
    state = abstract_state(model, optimizer, 0)
    with pytest.raises(sharding.MeshError, match=r"6 experts, which mesh\.expert=4"):
        sharding.state_shardings(abstract_mesh(1, 1, 1, expert=4), state, model.logical_axes,
                                 optimizer.tx, MeshConfig(expert=4))


@pytest.mark.slow
def test_bad_mesh_config_exits_2_with_one_line(tmp_path, capsys):
    done = run_cli("train", "--run-dir", str(tmp_path / "r"), "mesh.fsdp=3", devices=4)
    assert done.returncode == 2
    # The mesh is checked before any checkpoint manager starts: the one line is all there is.
    assert done.stderr.strip() == ("error: mesh fsdp=3 x tensor=1 = 3 devices does not divide "
                                   "the 4 devices of this run; choose sizes whose product "
                                   "divides 4")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
    assert main(["train", "--run-dir", str(tmp_path / "r2"), "mesh.pipeline=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'mesh.pipeline'; valid keys in mesh: "
                          "data, fsdp, expert, tensor") and err.count("\n") == 1


def test_a_preference_runs_reference_params_are_sharded_as_the_params():
    """The starting params an in-step reference keeps in the model state are a second copy of
    the weights: replicated, each device would hold all of them."""
    from trainrun.config import PreferenceConfig

    cfg = TransformerModel(d_model=32, layers=1, heads=4, seq_len=16, vocab=64)
    model = build_model(cfg, PreferenceConfig(reference="in_step"))
    optimizer = build_optimizer(OptimizerConfig(name="adam"), 10)
    state = abstract_state(model, optimizer, seed=0)
    shardings = sharding.state_shardings(abstract_mesh(1, 2, 2), state, model.logical_axes,
                                         optimizer.tx, MeshConfig(fsdp_min_size=0))
    params = jax.tree.map(lambda s: s.spec, shardings.params)
    assert any(spec != P() for spec in jax.tree.leaves(params))
    assert jax.tree.map(lambda s: s.spec, shardings.model_state["params"]) == params
    assert shardings.model_state["kept"].spec == P()
