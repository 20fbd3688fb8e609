"""XLA:GPU's deterministic mode is a default where JAX has a GPU plugin (and only there), a
user's ``--xla_gpu_deterministic_ops=false`` opts out of all of it, a flag the user set keeps
its value, and every flag is one this jaxlib's XLA knows (XLA aborts at backend start on a flag
it does not know)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trainrun import xla_flags
from trainrun.xla_flags import GPU_DETERMINISM_FLAGS, apply_default_flags, gpu_determinism_declined

GPU_FLAGS = [f"{name}={value}" for name, value in GPU_DETERMINISM_FLAGS.items()]


@pytest.fixture
def jaxlib(monkeypatch):
    def pretend(version: str) -> None:
        monkeypatch.setattr(xla_flags.metadata, "version", lambda name: version)

    return pretend


def test_gpu_determinism_only_where_a_gpu_plugin_is(jaxlib):
    jaxlib("0.11.2")
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert apply_default_flags(environ, gpu=False) == []  # 0.11: no CPU flag either
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    assert apply_default_flags(environ, gpu=True) == GPU_FLAGS
    assert environ["XLA_FLAGS"] == " ".join(["--xla_force_host_platform_device_count=2",
                                             *GPU_FLAGS])
    assert apply_default_flags(environ, gpu=True) == []  # applying twice adds nothing


def test_gpu_and_cpu_defaults_together_on_jaxlib_0_10(jaxlib):
    jaxlib("0.10.2")
    environ: dict[str, str] = {}
    assert apply_default_flags(environ, gpu=True) == [
        "--xla_cpu_experimental_ynn_fusion_type=", *GPU_FLAGS]


def test_an_unknown_jaxlib_gets_no_gpu_flags(jaxlib):
    jaxlib("0.12.0")
    environ: dict[str, str] = {}
    assert apply_default_flags(environ, gpu=True) == []
    assert "XLA_FLAGS" not in environ


@pytest.mark.parametrize("choice", ["--xla_gpu_deterministic_ops=false",
                                    "--xla_gpu_deterministic_ops=0",
                                    "--xla_gpu_exclude_nondeterministic_ops=False"])
def test_turning_determinism_off_opts_out_of_every_gpu_default(jaxlib, choice):
    jaxlib("0.11.2")
    environ = {"XLA_FLAGS": choice}
    assert gpu_determinism_declined(choice)
    assert apply_default_flags(environ, gpu=True) == []
    assert environ["XLA_FLAGS"] == choice


def test_a_flag_the_user_set_keeps_its_value(jaxlib):
    jaxlib("0.11.2")
    environ = {"XLA_FLAGS": "--xla_gpu_deterministic_ops --xla_gpu_enable_triton_gemm=true"}
    assert not gpu_determinism_declined(environ["XLA_FLAGS"])  # a bare flag means true
    assert apply_default_flags(environ, gpu=True) == [
        "--xla_gpu_enable_scatter_determinism_expander=true"]
    assert "--xla_gpu_enable_triton_gemm=true" in environ["XLA_FLAGS"]
    assert "--xla_gpu_enable_triton_gemm=false" not in environ["XLA_FLAGS"]


def test_the_cli_step_adds_nothing_after_the_gpu_defaults(jaxlib):
    from trainrun import resume

    jaxlib("0.11.2")
    environ: dict[str, str] = {}
    apply_default_flags(environ, gpu=True)
    before = environ["XLA_FLAGS"]
    assert not resume.gpu_determinism(environ)  # it defers to a determinism flag already set
    assert environ["XLA_FLAGS"] == before


def test_this_jaxlibs_xla_knows_every_gpu_flag():
    env = dict(os.environ, XLA_FLAGS=" ".join(GPU_FLAGS), JAX_PLATFORMS="cpu")
    program = "import jax.numpy as jnp; print(jnp.ones(3).sum())"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3.0"
