"""Process settings: ``import trainrun`` changes nothing but the documented XLA flags;
``configure_process`` makes glibc reuse freed memory and CPU calls run inline; XLA:GPU's
deterministic mode is a default where JAX has a GPU plugin (and only there), a user's
``--xla_gpu_deterministic_ops=false`` opts out of all of it, a flag the user set keeps its value,
and every flag is one this jaxlib's XLA knows (XLA aborts at backend start on a flag it does not
know)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env, losses, run_cli, run_python, save_tiny_gpt2

from trainrun.platform import process
from trainrun.platform.process import (
    DEVICE_COUNT_FLAG,
    GPU_DETERMINISM_FLAGS,
    apply_default_flags,
    gpu_determinism_declined,
    gpu_deterministic,
    with_device_count,
)

GPU_FLAGS = [f"{name}={value}" for name, value in GPU_DETERMINISM_FLAGS.items()]


@pytest.fixture
def jaxlib(monkeypatch):
    def pretend(version: str) -> None:
        monkeypatch.setattr(process.metadata, "version", lambda name: version)

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


@pytest.mark.parametrize(("flags", "on"), [
    (" ".join(GPU_FLAGS), True), ("--xla_gpu_deterministic_ops", True), ("", False),
    ("--xla_gpu_deterministic_ops=false", False), ("--xla_gpu_enable_triton_gemm=false", False),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=0", False),
    ("--xla_gpu_exclude_nondeterministic_ops=True", True),
    ("--xla_gpu_exclude_nondeterministic_ops=true --xla_gpu_deterministic_ops=false", True)])
def test_whether_xla_gpu_runs_deterministically_is_read_from_the_flags(flags, on):
    assert gpu_deterministic(flags) is on


def test_a_flag_the_user_set_keeps_its_value(jaxlib):
    jaxlib("0.11.2")
    environ = {"XLA_FLAGS": "--xla_gpu_deterministic_ops --xla_gpu_enable_triton_gemm=true"}
    assert not gpu_determinism_declined(environ["XLA_FLAGS"])  # a bare flag means true
    assert apply_default_flags(environ, gpu=True) == [
        "--xla_gpu_enable_scatter_determinism_expander=true"]
    assert "--xla_gpu_enable_triton_gemm=true" in environ["XLA_FLAGS"]
    assert "--xla_gpu_enable_triton_gemm=false" not in environ["XLA_FLAGS"]


def test_this_jaxlibs_xla_knows_every_gpu_flag():
    env = dict(os.environ, XLA_FLAGS=" ".join(GPU_FLAGS), JAX_PLATFORMS="cpu")
    program = "import jax.numpy as jnp; print(jnp.ones(3).sum())"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3.0"


IMPORT_CHANGES = """
    import json, os
    import jax
    names = sorted(jax.config.values)  # every option (async dispatch, x64, ...) and its value
    values = lambda: {n: repr(jax.config.values[n]) for n in names}
    before = (dict(os.environ), values())
    import trainrun
    after = (dict(os.environ), values())
    from trainrun.platform.process import backend_started
    env = {k: (before[0].get(k), after[0].get(k)) for k in before[0].keys() | after[0].keys()
           if before[0].get(k) != after[0].get(k)}
    config = {n: (before[1][n], after[1][n]) for n in names if before[1][n] != after[1][n]}
    print(json.dumps({"env": env, "config": config,
                      "backend": backend_started()}))
"""


@pytest.mark.slow
def test_import_changes_only_the_documented_xla_flag():
    done = run_python(IMPORT_CHANGES)
    assert done.returncode == 0, done.stderr[-2000:]
    changes = json.loads(done.stdout)
    assert changes["config"] == {}  # no jax.config value changed (async dispatch included)
    assert not changes["backend"]  # and JAX's backend was not started by the import
    assert changes["env"] == {"XLA_FLAGS": [None, "--xla_cpu_experimental_ynn_fusion_type="]}


LAZY_NAMES = """
    import sys
    import trainrun
    heavy = sorted(m for m in ("grain", "optax", "orbax", "flax") if m in sys.modules)
    from trainrun import run, load, ArrayBatches
    print(heavy, run.__module__, load.__module__, "grain" in sys.modules,
          set(trainrun.__all__) <= set(dir(trainrun)))
"""


def test_import_loads_the_public_names_when_first_used():
    """``import trainrun`` (as every command does first) leaves the data pipeline, optimizer,
    checkpointer and modules unimported until a public name that needs them is used."""
    done = run_python(LAZY_NAMES)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["[]", "trainrun.training.loop",
                                   "trainrun.evaluation.language_model", "True", "True"]


COLLECTOR_AT_EXIT = """
    import gc, json, sys
    from trainrun import cli
    try:
        code = getattr(cli, sys.argv[1])(["config", "show", "--config", "chat"])
    except SystemExit as ended:
        code = ended.code
    print(json.dumps({"code": code, "frozen": gc.get_freeze_count(),
                      "walked": len(gc.get_objects())}))
"""


@pytest.mark.parametrize("entry", ["command", "main"])
def test_a_commands_exit_leaves_its_objects_out_of_the_collectors_walk(entry):
    """The ``trainrun`` program (``cli.command``, its console script and ``python -m
    trainrun``) ends with every object alive left out of Python's collector (``gc.freeze``),
    so the exit's collections do not walk the objects JAX and trainrun made;
    ``cli.main`` in a library user's process leaves the collector as it was."""
    done = run_python(COLLECTOR_AT_EXIT, entry)
    assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads(done.stdout.splitlines()[-1])
    assert after["code"] in (0, None)
    if entry == "command":
        assert after["frozen"] > 100_000  # JAX, Flax and trainrun's objects
        assert after["walked"] < after["frozen"] / 100  # what the print made, and little else
    else:
        assert after["frozen"] == 0
        assert after["walked"] > 100_000


LOAD_AND_SCORE = """
    import sys
    import trainrun
    model = trainrun.load(sys.argv[1])
    print(model.logits([[1, 2, 3]]).shape, model.generate([1, 2], 3).shape,
          len(model.generate_batch([[1, 2], [3]], 3)))
    print(sorted(m for m in ("grain", "orbax") if m in sys.modules))
"""


def test_a_model_directory_is_loaded_scored_and_decoded_without_the_data_pipeline(tmp_path):
    """``trainrun.load`` of a Hugging Face directory (what ``sample``, ``eval`` and
    ``lm-eval`` do first) imports neither Grain nor Orbax: about a second of every such
    command's start on a small machine."""
    save_tiny_gpt2(tmp_path / "model", vocab=50)
    done = run_python(LOAD_AND_SCORE, str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["(1, 3, 50) (5,) 2", "[]"]


# A large block from malloc: glibc serves it from its own mmap by default; with trainrun's
# allocator setting (no mmap for large blocks) it comes from the brk heap, [heap] in the maps.
HEAP_CHECK = """
    import ctypes, sys
    import trainrun
    if sys.argv[1] == "configure":
        print(trainrun.configure_process())
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    address = libc.malloc(64 << 20)
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            print("in heap" if low <= address < high else "not in heap")
            break
    else:
        print("not in heap")
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("configure", [True, False])
def test_configure_process_makes_glibc_keep_large_blocks_on_its_heap(configure):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(HEAP_CHECK),
                           "configure" if configure else "import-only"], capture_output=True,
                          text=True, timeout=120, env=cli_env())
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    if configure:
        assert "allocator=True" in lines[0] and "inline_cpu_calls=True" in lines[0]
    assert lines[-1] == ("in heap" if configure else "not in heap")


def test_configure_process_after_the_backend_started_changes_nothing_and_says_so():
    done = run_python("""
        import jax, jax.numpy as jnp
        import trainrun
        jnp.ones(2).block_until_ready()
        settings = trainrun.configure_process()
        print(settings.applied(), jax.config.read("jax_cpu_enable_async_dispatch"))
        print(settings.notice)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    applied, notice = done.stdout.strip().splitlines()
    assert applied == "False True"
    assert notice.startswith("process settings not applied: JAX's backend had already started")


def test_settings_made_before_the_backend_started_are_reported_as_made_after_it():
    """trainrun train makes them, joins jax.distributed (the backend starts), then run() asks
    again: every launched process 0 printed 'process settings not applied'."""
    done = run_python("""
        import jax, jax.numpy as jnp
        import trainrun
        first = trainrun.configure_process()
        jnp.ones(2).block_until_ready()
        again = trainrun.configure_process()
        print(first.applied(), again.applied(), again == first, repr(again.notice))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "True", "''"]


def test_child_device_count_flag_replaces_any_count_already_set():
    flags = f"--xla_foo=1 {DEVICE_COUNT_FLAG}=8"
    assert with_device_count(flags, 2) == f"--xla_foo=1 {DEVICE_COUNT_FLAG}=2"


COMPILE_TWICE = """
    import sys, time
    from pathlib import Path
    from trainrun.platform.process import keep_compiled_programs
    folder = keep_compiled_programs(Path(sys.argv[1]) if sys.argv[1] != "-" else None)
    import jax, jax.numpy as jnp
    from jax._src import monitoring
    hits = []
    monitoring.register_event_listener(
        lambda event, **kw: hits.append(event) if "cache_hits" in event else None)
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    print(folder, float(f(jnp.ones((64, 64)))), len(hits))
"""


ZSTD_FRAME_MAGIC = bytes.fromhex("28b52ffd")


def test_a_second_command_reads_the_programs_the_first_compiled(tmp_path):
    """A command keeps the programs it compiles for the next process; a cache the user
    named through JAX's own variable is left to JAX."""
    folder = tmp_path / "compiled"
    # The suite's own cache (conftest.py) is named through the variable: unset here.
    runs = [run_python(COMPILE_TWICE, str(folder), JAX_COMPILATION_CACHE_DIR="")
            for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[0] == second[0] == str(folder) and first[1] == second[1]
    assert first[2] == "0" and int(second[2]) > 0  # compiled, then read back
    entries = list(folder.glob("*-cache"))
    # Kept as zstd frames (zstandard, a dependency), which JAX writes in half zlib's time.
    assert entries and all(e.read_bytes()[:4] == ZSTD_FRAME_MAGIC for e in entries)

    theirs = tmp_path / "theirs"
    named = run_python(COMPILE_TWICE, "-", JAX_COMPILATION_CACHE_DIR=str(theirs))
    assert named.returncode == 0, named.stderr[-2000:]
    assert named.stdout.split()[0] == "None" and any(theirs.iterdir())


def test_a_compiled_programs_folder_that_is_a_symlink_is_not_followed(tmp_path):
    """JAX evicts old programs from the folder it keeps them in: a symlink there (to a folder
    of the user's) is left alone and the command compiles as without a cache."""
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes-cache").write_text("mine")
    link = tmp_path / "compiled"
    link.symlink_to(users, target_is_directory=True)
    done = run_python(COMPILE_TWICE, str(link), JAX_COMPILATION_CACHE_DIR="")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "None"
    # The default folder, compiled/<host CPU> under the user cache, with compiled a symlink.
    default = run_python(COMPILE_TWICE, "-", JAX_COMPILATION_CACHE_DIR="",
                         TRAINRUN_COMPILATION_CACHE="", TRAINRUN_CACHE_DIR=str(tmp_path))
    assert default.returncode == 0, default.stderr[-2000:]
    assert default.stdout.split()[0] == "None"
    assert sorted(p.name for p in users.iterdir()) == ["notes-cache"]
    assert link.is_symlink() and (users / "notes-cache").read_text() == "mine"


FOLDER_CHOICES = """
    import json, os
    import jax
    from trainrun.platform.process import compiled_programs_folder, keep_compiled_programs
    var = "TRAINRUN_COMPILATION_CACHE"
    cases = {"unset": {}, "on": {var: "1"}, "off": {var: "0"}, "Off": {var: " Off "},
             "a folder": {var: "/srv/programs"},
             "JAX's variable": {"JAX_COMPILATION_CACHE_DIR": "/j"}}
    out = {name: str(compiled_programs_folder(env)) for name, env in cases.items()}
    out["this process (0)"] = str(keep_compiled_programs())
    out["JAX's dir after"] = str(jax.config.values["jax_compilation_cache_dir"] or None)
    jax.config.update("jax_compilation_cache_dir", "/theirs")
    out["JAX's option"] = str(compiled_programs_folder({}))
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    out["JAX's cache off"] = str(compiled_programs_folder({}))
    print(json.dumps(out))
"""


def test_the_compiled_program_folder_is_the_users_choice(tmp_path):
    """trainrun's user cache by default, split by the host's CPU (a home shared with other CPUs
    never runs their machine code); TRAINRUN_COMPILATION_CACHE turns it off or names the
    folder; a cache the user set up or turned off through JAX is left to JAX."""
    done = run_python(FOLDER_CHOICES, JAX_COMPILATION_CACHE_DIR="",
                      TRAINRUN_COMPILATION_CACHE="0", TRAINRUN_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    default = tmp_path / "cache" / "compiled" / process.host_cpu()
    assert out == {"unset": str(default), "on": str(default), "off": "None", "Off": "None",
                   "a folder": "/srv/programs", "JAX's variable": "None",
                   "this process (0)": "None", "JAX's dir after": "None",
                   "JAX's option": "None", "JAX's cache off": "None"}
    assert not (tmp_path / "cache").exists()  # turned off: nothing made


def same_state(a: Path, b: Path) -> bool:
    """Whether two runs' newest checkpoints hold the same step and the same bits."""
    import jax
    import numpy as np

    from trainrun.checkpointing.reader import latest_state, saved_config

    (step_a, state_a), (step_b, state_b) = (latest_state(r, saved_config(r)) for r in (a, b))
    leaves_a, leaves_b = jax.tree.leaves(state_a), jax.tree.leaves(state_b)
    return step_a == step_b and len(leaves_a) == len(leaves_b) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(leaves_a, leaves_b, strict=True))


@pytest.mark.slow
def test_a_second_train_reads_every_program_back_and_computes_the_same_bits(tmp_path):
    """`trainrun train` keeps its compiled programs; the same command again compiles none
    (every program read back), and its losses and checkpoint are the first run's bits and those
    of a run without the cache. A folder that cannot be written leaves the cache off with one
    warning line, and the run goes on."""
    folder = tmp_path / "compiled"
    blocked = tmp_path / "a-file"  # nothing can be made under a file
    blocked.write_text("mine\n")

    def train(name: str, cache: Path) -> set[str]:
        done = run_cli("train", "--run-dir", str(tmp_path / name), "steps=6", "steps_per_call=3",
                       JAX_COMPILATION_CACHE_DIR="", TRAINRUN_COMPILATION_CACHE=str(cache),
                       JAX_LOG_COMPILES="1")
        assert done.returncode == 0, done.stderr[-2000:]
        # The FLOPs of one step: the step traced alone on a first run, read back on a second.
        traced[name] = "Finished tracing train_step for jit" in done.stderr
        warned = [line for line in done.stderr.splitlines() if "compiled programs" in line]
        assert warned == ([] if cache == folder else [
            f"warning: compiled programs are not kept: cannot write {cache} (not a directory); "
            "make it writable, point TRAINRUN_COMPILATION_CACHE at a folder that is, or set "
            "it to 0"])
        return {p.name for p in folder.glob("*-cache")} if folder.exists() else set()

    traced: dict[str, bool] = {}
    first = train("first", folder)
    assert first  # the programs were kept
    assert train("second", folder) == first  # every program read back: none compiled anew
    assert train("without", blocked / "compiled") == first
    assert traced == {"first": True, "second": False, "without": True}
    counts = {name: json.loads((tmp_path / name / "summary.json").read_text())["flops_per_step"]
              for name in traced}
    assert counts["first"] > 0 and counts["second"] == counts["first"] == counts["without"]
    assert blocked.read_text() == "mine\n"
    assert np.array_equal(losses(tmp_path / "first").view(np.uint32),
                          losses(tmp_path / "second").view(np.uint32))
    assert np.array_equal(losses(tmp_path / "first").view(np.uint32),
                          losses(tmp_path / "without").view(np.uint32))
    assert same_state(tmp_path / "first", tmp_path / "second")
    assert same_state(tmp_path / "first", tmp_path / "without")


@pytest.mark.slow
def test_a_second_sample_reads_its_programs_back_and_draws_the_same_tokens(chat_run, tmp_path):
    """`trainrun sample` with its programs read back draws the tokens it drew compiling them,
    and those drawn without the cache."""
    run_dir, _ = chat_run
    folder = tmp_path / "compiled"

    def sample(cache: str) -> tuple[str, set[str]]:
        done = run_cli("sample", str(run_dir), "--chat", "reverse abc", "--tokens", "8",
                       "--temperature", "0.8", "--seed", "3", JAX_COMPILATION_CACHE_DIR="",
                       TRAINRUN_COMPILATION_CACHE=cache)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout, {p.name for p in folder.glob("*-cache")}

    cold, kept = sample(str(folder))
    assert kept
    assert sample(str(folder)) == (cold, kept)  # every program read back, the same tokens
    assert sample("0") == (cold, kept)
