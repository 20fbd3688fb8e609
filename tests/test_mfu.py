"""MFU: the FLOP count is XLA's count of the compiled step and equals the hand count for a
model of matmuls only; the MLP's MFU against a measured CPU ceiling lies in (0, 1)."""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainrun import mfu
from trainrun.cli import main
from trainrun.config import load_config
from trainrun.loop import run
from trainrun.models import from_functions

M, K, P, N = 256, 192, 160, 128  # (a @ b) @ c with a [M, K], b [K, P], c [P, N]


def matmul_chain():
    def init(key):
        ka, kb, kc = jax.random.split(key, 3)
        return {"a": jax.random.normal(ka, (M, K)) * 0.05,
                "b": jax.random.normal(kb, (K, P)) * 0.05,
                "c": jax.random.normal(kc, (P, N)) * 0.05}

    def loss(params, batch, key):
        del key
        return jnp.mean((params["a"] @ params["b"] @ params["c"] - batch["y"]) ** 2)

    return from_functions(init, loss, name="matmul-chain")


def batches():
    y = np.random.default_rng(0).normal(size=(M, N)).astype(np.float32)
    while True:
        yield {"y": y}


# Two matmuls; each needs its forward product and, backward, the gradient of both of its
# operands (all are params): 3 x 2·m·n·k each.
HAND_COUNT = 3 * (2 * M * K * P + 2 * M * P * N)


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_matmul_only_flops_equal_the_hand_count(tmp_path, steps_per_call):
    config = load_config("mlp", ["steps=4", f"steps_per_call={steps_per_call}",
                                 "checkpoint.every=0", "optimizer.name=sgd",
                                 "metrics.tensorboard=false"])
    summary = run(config, tmp_path / "run", model=matmul_chain(), data=batches(),
                  out=io.StringIO())
    assert summary["flops_per_step"] == pytest.approx(HAND_COUNT, rel=0.05)
    assert summary["flops_per_s"] > 0


def test_mlp_mfu_is_reported_and_between_zero_and_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["bench", "ceiling", "--size", "512", "--repeats", "3"]) == 0
    assert "GFLOP/s" in capsys.readouterr().out
    ceiling = mfu.cached_ceiling()
    assert ceiling is not None and ceiling["flops_per_s"] > 1e8

    summary = run(load_config("mlp", ["steps=100", "log_every=10", "checkpoint.every=0"]),
                  tmp_path / "run", out=io.StringIO())
    assert 0 < summary["mfu"] < 1
    assert summary["mfu"] == pytest.approx(summary["flops_per_s"] / ceiling["flops_per_s"])
    assert "bench ceiling" in summary["peak"]["source"]
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["mfu"] == summary["mfu"] and saved["flops_per_step"] > 0

    # The same summary splits the wall time into parts that add up, and gives goodput.
    split = summary["wall_time_split_s"]
    assert {"compile", "data_wait", "step_compute", "checkpoint", "eval", "logging"} <= set(split)
    assert sum(split.values()) == pytest.approx(summary["wall_s"], rel=1e-6)
    assert split["compile"] > 0 and split["step_compute"] > 0 and split["logging"] > 0
    assert summary["goodput"] == pytest.approx(split["step_compute"] / summary["wall_s"])


def test_without_a_ceiling_mfu_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "empty"))
    peak, why = mfu.find_peak("cpu", "cpu", 1)
    assert peak is None and "trainrun bench ceiling" in why


@pytest.mark.parametrize(("kind", "dtype", "entry", "per_chip"), [
    ("NVIDIA H100 80GB HBM3", "bfloat16", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "float32", "tf32", 378e12),
    ("NVIDIA H200", "bfloat16", "bf16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "float32", "tf32", 156e12),
    ("TPU v4", "bfloat16", "bf16", 275e12),
    ("TPU v5 lite", "float32", "bf16", 197e12),  # f32 matmuls run as bf16 passes on the MXU
    ("TPU v5p", "bfloat16", "bf16", 459e12),
])
def test_datasheet_peaks(kind, dtype, entry, per_chip):
    platform = "tpu" if kind.startswith("TPU") else "gpu"
    peak, _ = mfu.find_peak(platform, kind, 8, dtype)
    assert peak.entry == entry and peak.flops_per_s == pytest.approx(8 * per_chip)
    with jax.default_matmul_precision("highest"):
        full, why = mfu.find_peak(platform, kind, 1, "float32")
    if platform == "gpu":
        assert full.entry == "fp32" and full.flops_per_s < peak.flops_per_s / 8
    else:
        assert full is None and "fp32" in why  # no published TPU fp32 figure
