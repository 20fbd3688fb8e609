"""The non-finite guard as branches: a K-step call with a NaN step in its middle ends in the
select's state to the bit, whatever the grouping; on CPU the program holds conditionals over a
few leaves and no select, on a TPU and a GPU the select."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from trainrun.config import MLPModel, OptimizerConfig, RegressionData
from trainrun.data.synthetic import regression_arrays
from trainrun.fast.guard import CPU_BRANCH_LEAVES, branches_of, keep_if_not_branched
from trainrun.models.mlp import make_mlp
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.program.step import keep_if_not, make_multi_step, make_train_step


def _batches(steps: int, nan_at: int) -> dict[str, np.ndarray]:
    """``steps`` full batches stacked for one K-step call; the one of ``nan_at`` holds a NaN."""
    data = regression_arrays(RegressionData())
    stacked = {name: np.stack([value] * steps) for name, value in data.items()}
    stacked["x"][nan_at, 3, 2] = np.nan
    return stacked


@pytest.mark.parametrize("leaves", [1, CPU_BRANCH_LEAVES])
def test_branches_under_a_scan_skip_a_nan_step_to_the_select_s_bits(leaves):
    model = make_mlp(MLPModel())
    optimizer = build_optimizer(OptimizerConfig(lr=0.01), total_steps=20)
    batches = _batches(7, nan_at=3)

    def call(keep):
        multi = jax.jit(make_multi_step(make_train_step(model, optimizer, keep=keep)))
        return multi(init_state(model, optimizer, seed=0), batches)

    (state, metrics), (want, want_metrics) = call(branches_of(leaves)), call(keep_if_not)
    assert np.isnan(metrics["loss"][3]) and int(state.nonfinite_steps) == 1
    assert int(state.step) == 7 and not np.isnan(metrics["loss"][6])
    for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(ref).tobytes()
    for name in ("loss", "grad_norm", "param_norm"):
        assert np.asarray(metrics[name]).tobytes() == np.asarray(want_metrics[name]).tobytes()
    # the skipped step changed nothing: steps 3 and 4 see the same params
    assert float(metrics["param_norm"][2]) == float(metrics["param_norm"][3])


def _lowered_for(platform: str, leaves: int) -> tuple[str, list[int]]:
    """The guard's program lowered for ``platform`` (on this CPU), and how many values each
    of its conditionals of more than one result returns."""
    new = [jnp.full((3, 2), float(i)) for i in range(leaves)]
    old = [jnp.zeros((3, 2)) for _ in range(leaves)]
    fn = jax.jit(lambda finite, n, o: keep_if_not_branched(finite, n, o))
    text = export.export(fn, platforms=(platform,))(jnp.bool_(True), new, old).mlir_module()
    return text, [int(n) for n in re.findall(r':(\d+) = "stablehlo.case"', text)]


def test_on_cpu_the_guard_is_conditionals_and_on_a_tpu_and_a_gpu_the_select():
    leaves = 3 * CPU_BRANCH_LEAVES + 1
    tpu, tpu_cases = _lowered_for("tpu", leaves)
    # measured faster there than a branch (the one case of every platform: which runs)
    assert "stablehlo.select" in tpu and tpu_cases == [leaves]
    cpu, cpu_cases = _lowered_for("cpu", leaves)
    assert "stablehlo.select" not in cpu and CPU_BRANCH_LEAVES in cpu_cases
    gpu, _ = _lowered_for("cuda", leaves)
    assert "stablehlo.select" in gpu  # on a GPU a branch waits for the host: the select
