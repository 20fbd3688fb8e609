"""init.from a Hugging Face model directory or a PEFT adapter directory in a ``gs://`` or
``s3://`` bucket (both emulators): the model loads bit for bit as from the same directory on
disk, shard by shard through ranged reads with no shard copied to this machine, and a
fine-tune from it trains as one from disk does; what is not there is one line."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import hf_logits, losses, save_tiny_causal_lm

from trainrun.checkpointing.init_from import initial_state, readers, resolved, source_kind
from trainrun.config import LoraConfig, load_config
from trainrun.models import build_model
from trainrun.models.huggingface import Tensors, WeightsError
from trainrun.models.peft import write_adapter_dir
from trainrun.models.transformer import bind_transformer
from trainrun.program.optim import build_optimizer
from trainrun.program.precision import policy_from_config
from trainrun.program.state import abstract_state
from trainrun.storage import location, remote
from trainrun.training.loop import run

pytest.importorskip("transformers", reason="the tests' extra holds transformers")

TOKENS = np.random.default_rng(3).integers(0, 256, (2, 24))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers in several shards with their index."""
    path = save_tiny_causal_lm(tmp_path_factory.mktemp("llama") / "model", "llama",
                               vocab_size=256, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a folder named gs: or s3: would be made
    yield
    assert [p for p in tmp_path.rglob("*") if p.name in ("gs:", "s3:")] == []


def upload(folder: Path, url: str) -> str:
    for file in folder.iterdir():
        location.location(f"{url}/{file.name}").write_bytes(file.read_bytes())
    return url


def finetune(tmp_path: Path, source: str, *extra: str):
    corpus = tmp_path / "corpus.py"
    corpus.write_bytes(b"def add(a, b):\n    return a + b\n\n" * 80)
    return resolved(load_config("finetune", [
        "steps=4", "steps_per_call=2", "checkpoint.every=0", "eval.every=0",
        "optimizer.lr=0.003", "optimizer.schedule.warmup=0", f"init.from={source}",
        f"data.paths=[{corpus}]", "data.seq_len=32", "data.batch_size=4",
        "metrics.tensorboard=false", *extra]))


def start(config):
    """The state a run of ``config`` starts from, on one device."""
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, 4)
    policy = policy_from_config(config.precision)
    abstract = abstract_state(model, optimizer, config.seed, policy)
    return initial_state(config, model, optimizer, policy, None, abstract)


def logits(config, state) -> np.ndarray:
    return np.asarray(bind_transformer(config.model)(state.params)(jnp.asarray(TOKENS))[0])


def temp_files() -> dict[str, int]:
    """Every file in the temporary directory, with its size."""
    found = {}
    for root, _, names in os.walk(tempfile.gettempdir()):
        for name in names:
            with contextlib.suppress(OSError):
                found[os.path.join(root, name)] = os.path.getsize(os.path.join(root, name))
    return found


def test_each_tensor_of_a_sharded_llama_in_a_bucket_is_read_by_ranges_as_from_disk(
        llama_dir, bucket, tmp_path, monkeypatch):
    url = upload(llama_dir, f"{bucket}/models/llama")
    (tmp_path / "tmp").mkdir()  # this test's temporary directory: what is made there is seen
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    shards = {f.stat().st_size for f in llama_dir.glob("model-*.safetensors")}
    requested: list[int] = []
    read_range = remote.ObjectLocation.read_range

    def spy(path, begin: int, end: int) -> bytes:
        requested.append(end - begin)
        return read_range(path, begin, end)

    whole = remote.ObjectLocation.read_bytes

    def read_bytes(path) -> bytes:
        assert not str(path).endswith(".safetensors"), f"{path} read whole"
        return whole(path)

    monkeypatch.setattr(remote.ObjectLocation, "read_range", spy)
    monkeypatch.setattr(remote.ObjectLocation, "read_bytes", read_bytes)
    before = temp_files()
    here, there = Tensors.of(location.location(url)), Tensors.of(location.location(llama_dir))
    assert here.names == there.names and len(here.names) > 10
    for name in sorted(there.names):
        assert (here.shape(name), here.dtype(name)) == (there.shape(name), there.dtype(name))
        np.testing.assert_array_equal(here.read(name), there.read(name))
        rows = (slice(1, 3), *(slice(None),) * (len(there.shape(name)) - 1))
        if there.shape(name) and there.shape(name)[0] > 3:  # a device's rows: those alone
            np.testing.assert_array_equal(here.read(name, rows), there.read(name, rows))
    # tensor by tensor: no request the size of a shard, and no shard's copy on disk
    assert requested and max(requested) < min(shards)
    made = {path for path, size in temp_files().items() if before.get(path) != size}
    assert [path for path in made if temp_files().get(path) in shards] == []


def test_bfloat16_weights_in_a_bucket_read_as_from_disk(bucket, tmp_path):
    """numpy has no bfloat16: a local file is read through JAX, an object through ml_dtypes;
    both widen the same bits to float32."""
    path = save_tiny_causal_lm(tmp_path / "bf16", "qwen2", vocab_size=256, dtype="bfloat16")
    url = upload(path, f"{bucket}/models/bf16")
    file = location.location(f"{url}/model.safetensors")
    assert source_kind(file) == "safetensors" and source_kind(location.location(url)) == (
        "huggingface")
    here, there = Tensors.of(file), Tensors.of(path / "model.safetensors")
    assert {here.dtype(name) for name in here.names} == {"BF16"}
    for name in sorted(there.names):
        np.testing.assert_array_equal(here.read(name), there.read(name))


@pytest.mark.slow
def test_a_sharded_llama_in_a_bucket_starts_a_run_with_the_local_logits(llama_dir, bucket,
                                                                       tmp_path):
    url = upload(llama_dir, f"{bucket}/models/llama")
    assert source_kind(location.location(url)) == "huggingface"
    here, there = finetune(tmp_path, url), finetune(tmp_path, str(llama_dir))
    assert here.model == there.model and here.model.kv_heads == 2
    ours, theirs = start(here), start(there)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(logits(here, ours), logits(there, theirs))
    np.testing.assert_allclose(logits(here, ours), hf_logits(llama_dir, TOKENS), rtol=0,
                               atol=1e-4)


@pytest.mark.slow
def test_a_fine_tune_from_a_bucket_trains_as_one_from_disk(llama_dir, bucket, tmp_path):
    url = upload(llama_dir, f"{bucket}/models/llama")
    run(finetune(tmp_path, url), tmp_path / "here", out=io.StringIO())
    run(finetune(tmp_path, str(llama_dir)), tmp_path / "there", out=io.StringIO())
    here, there = losses(tmp_path / "here"), losses(tmp_path / "there")
    assert len(here) == 4 and here[-1] < here[0]  # it trains
    np.testing.assert_array_equal(here, there)


def adapters_for(config, rng: np.random.Generator) -> dict:
    """Random LoRA adapters on q and v of every layer of ``config``'s model (rank 2)."""
    cfg = config.model
    kv = (cfg.kv_heads or cfg.heads) * cfg.attention_head_dim
    return {"blocks": {str(i): {"attn": {
        "q_lora": {"a": rng.normal(size=(cfg.d_model, 2)).astype(np.float32),
                   "b": rng.normal(size=(2, cfg.d_model)).astype(np.float32)},
        "v_lora": {"a": rng.normal(size=(cfg.d_model, 2)).astype(np.float32),
                   "b": rng.normal(size=(2, kv)).astype(np.float32)}}}
        for i in range(cfg.layers)}}


@pytest.mark.slow
def test_a_peft_adapter_directory_in_a_bucket_loads_its_adapters_and_remote_base(
        llama_dir, bucket, tmp_path):
    base_url = upload(llama_dir, f"{bucket}/models/llama")
    cfg = finetune(tmp_path, str(llama_dir)).model.model_copy(
        update={"lora": LoraConfig(rank=2, alpha=4.0, targets=("q", "v"))})
    params = adapters_for(finetune(tmp_path, str(llama_dir)), np.random.default_rng(0))
    local = write_adapter_dir(params, cfg, "llama", str(llama_dir), tmp_path / "adapters")
    remote_dir = tmp_path / "remote-adapters"
    write_adapter_dir(params, cfg, "llama", base_url, remote_dir)  # its base in the bucket too
    url = upload(remote_dir, f"{bucket}/adapters")
    assert source_kind(location.location(url)) == "adapter"
    here, there = finetune(tmp_path, url), finetune(tmp_path, str(local))
    assert here.model.lora == there.model.lora == LoraConfig(rank=2, alpha=4.0,
                                                             targets=("q", "v"))
    ours, theirs = start(here), start(there)
    for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(logits(here, ours), logits(there, theirs))
    found = readers(url, here.model, abstract_state(
        build_model(here.model), build_optimizer(here.optimizer, 4), 0,
        policy_from_config(here.precision)).params)
    np.testing.assert_array_equal(found["blocks.1.attn.q_lora.a"](None),
                                  params["blocks"]["1"]["attn"]["q_lora"]["a"])


def test_a_damaged_or_missing_source_in_a_bucket_is_one_line(llama_dir, bucket, tmp_path):
    url = upload(llama_dir, f"{bucket}/models/llama")
    with pytest.raises(WeightsError, match=r"init\.from: no object or folder .*/models/nothing; "
                       "give the location of a run, a model directory") as err:
        finetune(tmp_path, f"{bucket}/models/nothing")
    assert "\n" not in str(err.value)
    scheme = remote.scheme_of(bucket)
    with pytest.raises(remote.StorageRefused, match="bucket 'no-such-bucket-here' does not "
                       "exist"):
        finetune(tmp_path, f"{scheme}://no-such-bucket-here/model")
    # a shard cut short: its header's offsets run past the object's end
    shard = sorted(llama_dir.glob("model-*.safetensors"))[0]
    cut = location.location(f"{url}/{shard.name}")
    cut.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(WeightsError, match=rf"cannot read .*/{shard.name}: tensor '.*' .* has "
                       r"data_offsets \[\d+, \d+\] outside the object's \d+ bytes .*; is the "
                       "file complete") as err:
        start(finetune(tmp_path, url))
    assert "\n" not in str(err.value)
    cut.delete()
    with pytest.raises(WeightsError, match=rf"index\.json lists {shard.name}, which is not in"):
        start(finetune(tmp_path, url))
