"""Commands besides `train` answer bad input and a hostile environment in one line: exit 2 for
input, 1 for the environment, nothing of the user's changed."""

from __future__ import annotations

import io
import itertools
import re
import shutil
import subprocess
import sys

import pytest
from conftest import cli_env

from trainrun.cli import main
from trainrun.config import load_config
from trainrun.platform.host_memory import HostMemory
from trainrun.training.loop import run


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "mlp"
    run(load_config("mlp", ["steps=4", "checkpoint.every=0", "metrics.tensorboard=false"]), path,
        out=io.StringIO())
    return path


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_compare_to_an_unknown_format_or_an_unwritable_place(mlp_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["compare", str(mlp_run), "--out", str(tmp_path / "thesis.txt")]) == 2
    assert "matplotlib writes no .txt file" in one_line(capsys)
    blocked = tmp_path / "a-file"  # a folder that cannot be made: the environment, exit 1
    blocked.write_text("mine\n")
    assert main(["compare", str(mlp_run), "--out", str(blocked / "c.png")]) == 1
    assert "cannot write" in one_line(capsys)
    assert blocked.read_text() == "mine\n"
    assert not (tmp_path / "thesis.txt").exists()


def test_bench_ceiling_with_a_cache_dir_that_is_a_file(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.write_text("not a directory\n")
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(cache))
    assert main(["bench", "ceiling", "--size", "64", "--repeats", "1"]) == 1
    assert "TRAINRUN_CACHE_DIR" in one_line(capsys)
    assert cache.read_text() == "not a directory\n"
    # garbage in the cache file is replaced, not a traceback
    monkeypatch.setenv("TRAINRUN_CACHE_DIR", str(tmp_path / "dir"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "ceiling.json").write_text("[1, 2]")
    assert main(["bench", "ceiling", "--size", "64", "--repeats", "1"]) == 0


@pytest.mark.slow
def test_export_of_the_default_lm_names_the_layouts_that_export(tmp_path, capsys):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 40)
    config = load_config("lm", ["steps=2", "steps_per_call=1", "checkpoint.every=0",
                                "eval.every=0", "optimizer.schedule.warmup=1",
                                "model.d_model=32", "model.layers=1", "model.seq_len=32",
                                f"data.paths=[{corpus}]", "data.seq_len=32",
                                "data.batch_size=4", "metrics.tensorboard=false"])
    run(config, tmp_path / "lm", out=io.StringIO())
    assert main(["export", str(tmp_path / "lm"), "--to", str(tmp_path / "out")]) == 2
    assert "no Hugging Face family's" in one_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("run_dir", ["runs/" + "x" * 300, "/".join(["runs"] + ["y" * 200] * 22)])
def test_a_run_dir_the_file_system_would_refuse_is_one_line(tmp_path, monkeypatch, capsys,
                                                            run_dir):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "mlp", "--run-dir", run_dir]) == 2
    assert "--run-dir" in one_line(capsys)
    assert list(tmp_path.iterdir()) == []  # no runs/ left


def test_a_platform_this_machine_lacks_is_one_line(tmp_path, cli):
    result = cli("train", "--config", "mlp", cwd=tmp_path, JAX_PLATFORMS="cuda")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "JAX_PLATFORMS=cuda" in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_checkpoint_step_replaced_by_a_link_is_one_line(tmp_path, capsys):
    """Before, every later run failed deleting it as an old step (rmtree on a link)."""
    args = ["train", "--config", "mlp", "--run-dir", str(tmp_path / "run"),
            "checkpoint.every=2", "checkpoint.keep=2", "metrics.tensorboard=false"]
    assert main([*args, "steps=4"]) == 0
    capsys.readouterr()
    step = tmp_path / "run" / "checkpoints" / "2"
    step.rename(tmp_path / "elsewhere")
    step.symlink_to(tmp_path / "elsewhere")
    assert main([*args, "steps=10"]) == 2
    assert "is a symbolic link" in one_line(capsys)
    assert step.is_symlink() and (tmp_path / "elsewhere").is_dir()  # nothing of it touched


@pytest.mark.slow
def test_a_half_deleted_step_and_a_garbled_step_record_are_handled_without_absl_lines(
        tmp_path, cli):
    """Before, every resume printed `WARNING:absl:Metadata file does not exist` for an old step
    whose deletion a kill cut short, and `ERROR:absl:Failed to json parse` twice for a step
    record with garbage in it."""
    args = ["train", "--config", "mlp", "--run-dir", str(tmp_path / "run"),
            "checkpoint.every=2", "checkpoint.keep=5", "metrics.tensorboard=false"]
    assert cli(*args, "steps=6").returncode == 0
    steps = tmp_path / "run" / "checkpoints"
    (steps / "2" / "_CHECKPOINT_METADATA").unlink()  # a deletion cut short
    shutil.rmtree(steps / "2" / "state")
    (steps / "4" / "_CHECKPOINT_METADATA").write_text("garbage{\n")
    result = cli(*args, "steps=8")
    assert result.returncode == 0, result.stderr
    assert "absl" not in result.stderr + result.stdout, result.stderr
    assert "removed the rest of step 2" in result.stdout
    assert "rewrote step 4's _CHECKPOINT_METADATA" in result.stdout
    assert sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) == [4, 6, 8]
    again = cli(*args, "steps=10")
    assert again.returncode == 0 and "absl" not in again.stderr + again.stdout
    assert "rewrote" not in again.stdout and "removed the rest" not in again.stdout


def test_a_train_state_that_cannot_fit_is_refused_before_anything(tmp_path, capsys):
    """Before, `model.hidden=[40000, 40000]` and larger died in XLA's allocator with a
    traceback (RESOURCE_EXHAUSTED), the run directory left behind."""
    code = main(["train", "--config", "mlp", "--run-dir", str(tmp_path / "run"),
                 "model.hidden=[200000,200000]"])
    assert code == 2
    err = one_line(capsys)
    assert "the train state needs" in err and "GiB" in err and "is free" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_allocation_that_fails_mid_run_is_one_line_with_the_last_checkpoint(tmp_path,
                                                                                capsys):
    from trainrun import rundir
    from trainrun.training.callbacks import Callback

    class Exhausted(Callback):
        every = 4

        def at_boundary(self, boundary):
            if boundary.step == 8:
                boundary.wait_for_checkpoint()
                raise MemoryError("Unable to allocate 191. GiB")

    config = load_config("mlp", ["steps=20", "steps_per_call=2", "checkpoint.every=4",
                                 "checkpoint.async=false", "metrics.tensorboard=false"])
    with pytest.raises(Exception) as err:
        run(config, tmp_path, out=io.StringIO(), callbacks=[Exhausted()])
    assert type(err.value).__name__ == "OutOfMemory"
    line = str(err.value)
    last = rundir.committed_steps(tmp_path / rundir.CHECKPOINTS)[-1]
    assert last > 0 and "\n" not in line
    assert line.startswith("out of memory (Unable to allocate 191. GiB); the last committed "
                           f"checkpoint is step {last}; lower data.batch_size")
    status = rundir.read_status(tmp_path)
    assert status["status"] == "failed" and status["step"] == last
    assert status["reason"] == line


def _mlp_state_bytes(hidden: list[int], features: int = 8) -> int:
    """The MLP's params, Adam's two moments: float32 each (the counters aside)."""
    widths = [features, *hidden, 1]
    params = sum(a * b + b for a, b in itertools.pairwise(widths))
    return 3 * 4 * params


def test_a_step_program_that_cannot_fit_is_refused_before_anything(tmp_path, monkeypatch,
                                                                    capsys):
    """The state fits; the compiled step (its gradients and Adam's temporaries on top) does
    not. Before, only the state was checked: the run started and died in the allocator."""
    from trainrun.training import preflight

    hidden = [1000, 1000]
    free = int(1.5 * _mlp_state_bytes(hidden))  # room for the state, not for the step
    monkeypatch.setattr(preflight, "host_memory_free",
                        lambda: HostMemory(free, "(MemAvailable)", False))
    code = main(["train", "--config", "mlp", "--run-dir", str(tmp_path / "run"),
                 f"model.hidden=[{hidden[0]},{hidden[1]}]", "steps_per_call=2"])
    assert code == 2
    err = one_line(capsys)
    assert "the compiled training step needs" in err and "a 2-step call" in err
    needed = float(err.split("needs ")[1].split(" MiB")[0])
    assert needed * 2**20 > free  # XLA's figure, above what was free
    assert f"and {free / 2**20:,.1f} MiB is free" in err and "steps_per_call" in err
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_names_a_batch_size_that_then_trains(tmp_path, monkeypatch, capsys):
    """A step whose activations grow with the batch: the refusal names the largest batch size
    whose program fits by XLA's count, found by one more compile at another size, and a run at
    that size passes the same check and trains. Before, the line said only to lower
    data.batch_size."""
    from trainrun.training import preflight

    def train(batch: int, free: int) -> int:
        monkeypatch.setattr(preflight, "host_memory_free",
                            lambda: HostMemory(free, "(MemAvailable)", False))
        return main(["train", "--config", "mlp", "--run-dir", str(tmp_path / f"run-{batch}"),
                     "model.hidden=[512]", f"data.examples={batch}", f"data.batch_size={batch}",
                     "data.shuffle=true", "steps=2", "steps_per_call=1", "checkpoint.every=0",
                     "metrics.tensorboard=false"])  # shuffled: batches from the host

    batch = 16384
    assert train(batch, free=2**20) == 2  # what the step needs, from the line
    needed = float(one_line(capsys).split("needs ")[1].split(" MiB")[0]) * 2**20
    free = int(needed * 0.6)
    assert train(batch, free) == 2
    err = one_line(capsys)
    found = re.search(r"data\.batch_size=(\d+) fits by XLA's count \(it is 16384\); or lower "
                      r"steps_per_call", err)
    assert found is not None, err
    fits = int(found.group(1))
    assert batch // 4 < fits < batch
    assert not (tmp_path / f"run-{batch}").exists()
    assert train(fits, free) == 0, capsys.readouterr().err
    assert (tmp_path / f"run-{fits}" / "summary.json").is_file()


def test_a_step_xla_refuses_to_compile_for_memory_names_a_batch_size_that_trains(
        tmp_path, monkeypatch, capsys):
    """On a TPU, XLA refuses as it compiles a program whose temporaries exceed the chip's
    memory (RESOURCE_EXHAUSTED, "Ran out of memory on HBM"), so no compiled program is there
    to measure. Here XLA:CPU's compiler is made to refuse as a TPU's does, with the chip's
    words and the program's own temporaries, at a memory that takes about a third of the
    run's batch: the refusal is one line naming a batch size that fits, found by compiling at
    halves of the run's until one compiles (the first half is refused too), and a run at that
    size compiles, passes the check and trains. Before, the compile's error ended the run
    with a generic out-of-memory line, exit 1, no batch named."""
    import jax

    from trainrun.training import preflight

    def train(batch: int, free: int) -> int:
        monkeypatch.setattr(preflight, "host_memory_free",
                            lambda: HostMemory(free, "(MemAvailable)", False))
        return main(["train", "--config", "mlp", "--run-dir", str(tmp_path / f"run-{batch}"),
                     "model.hidden=[512]", f"data.examples={batch}", f"data.batch_size={batch}",
                     "data.shuffle=true", "steps=2", "steps_per_call=1", "checkpoint.every=0",
                     "metrics.tensorboard=false"])

    batch = 16384
    assert train(batch, free=2**20) == 2  # what the step needs, from the line
    needed = float(one_line(capsys).split("needs ")[1].split(" MiB")[0]) * 2**20
    memory = int(needed * 0.3)
    compile_program = jax.stages.Lowered.compile
    compiles = []  # (rows of a step program's batch, whether it compiled)

    def compile_as_a_tpu(lowered, *args, **kwargs):
        compiled = compile_program(lowered, *args, **kwargs)
        temporaries = compiled.memory_analysis().temp_size_in_bytes
        taken = lowered.args_info[0]
        batch = taken[1] if len(taken) == 2 and isinstance(taken[1], dict) else {}
        if "x" in batch:
            compiles.append((batch["x"].shape[0], temporaries <= memory))
        if temporaries > memory:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                f"HLO temporaries ({temporaries / 2**30:.2f}G) exceeds available HBM "
                f"({memory / 2**30:.2f}G).")
        return compiled

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_as_a_tpu)
    assert train(batch, memory) == 2
    err = one_line(capsys)
    assert err.startswith("error: the compiled training step does not fit cpu:0: XLA "
                          "refused to compile a 1-step call (RESOURCE_EXHAUSTED: Ran out of "
                          "memory on HBM, the total memory required for HLO temporaries ("), err
    found = re.search(r"data\.batch_size=(\d+) fits by XLA's count \(it is 16384\); or lower "
                      r"steps_per_call", err)
    assert found is not None, err
    fits = int(found.group(1))
    assert batch // 4 < fits < batch // 2  # above the half that compiled, below the refused
    # halves until one compiles, then one more compile for the need's growth a row
    assert compiles == [(batch, False), (batch // 2, False), (batch // 4, True),
                        (batch // 8, True)], compiles
    assert not (tmp_path / f"run-{batch}").exists()
    assert train(fits, memory) == 0, capsys.readouterr().err
    assert (tmp_path / f"run-{fits}" / "summary.json").is_file()


@pytest.mark.slow
def test_a_step_program_over_the_address_space_limit_is_refused_before_anything(tmp_path):
    """``ulimit -v`` bounds what a process can map, whatever MemAvailable says; JAX and XLA map
    much of it at start, so what counts is the limit less what the process maps already. The
    limit here leaves about 1 GiB over what a process with JAX's backend started maps; the step
    needs 4 GiB. Before, the check passed and the first step died out of memory, after the run
    directory existed."""
    probe = subprocess.run([sys.executable, "-c", (
        "import re, jax, jax.numpy as jnp, trainrun\n"
        "jax.jit(lambda x: x @ x)(jnp.ones((64, 64))).block_until_ready()\n"
        "print(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1))")],
        capture_output=True, text=True, timeout=120, env=cli_env())
    limit = int(probe.stdout) * 1024 + 2**30
    run_dir = tmp_path / "run"
    under_limit = ("import os, resource, sys\n"  # set, then exec: no fork of this process
                   "resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2)\n"
                   "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
    done = subprocess.run(
        [sys.executable, "-c", under_limit, str(limit), "-m", "trainrun", "train", "--run-dir",
         str(run_dir), "model.hidden=[1024]", "data.batch_size=524288", "data.examples=524288",
         "steps=2", "metrics.tensorboard=false"], capture_output=True, text=True, timeout=300,
        env=cli_env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr
    line = done.stderr
    assert line.startswith("error: the compiled training step needs "), line
    assert "is free (under the address-space limit: ulimit -v " in line, line
    assert line.rstrip().endswith("; or raise that limit"), line
    found = re.search(r"needs ([\d.]+) GiB of host memory .* and ([\d.]+) GiB is free", line)
    assert found is not None, line
    needed, free = float(found.group(1)), float(found.group(2))
    assert free < 2 < needed  # XLA's figure against what the limit leaves, not MemAvailable
    assert not run_dir.exists()


def test_a_step_program_that_fits_is_compiled_once(tmp_path, monkeypatch, caplog):
    """The program set-up compiles on shapes to check its memory is the one the calls run:
    JAX lowers `train_steps` once (a second lowering would be a second compile)."""
    import logging

    from trainrun.training import preflight

    hidden = [1000, 1000]
    monkeypatch.setattr(preflight, "host_memory_free",
                        lambda: HostMemory(10 * _mlp_state_bytes(hidden), "(MemAvailable)"))
    caplog.set_level(logging.DEBUG, logger="jax._src.interpreters.pxla")
    summary = run(load_config("mlp", [f"model.hidden=[{hidden[0]},{hidden[1]}]", "steps=4",
                                      "steps_per_call=2", "checkpoint.every=0",
                                      "metrics.tensorboard=false"]),
                  tmp_path / "run", out=io.StringIO())
    assert summary.steps_done == 4
    lowered = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(train_steps)")]
    assert len(lowered) == 1, [r.getMessage()[:120] for r in lowered]
