"""Checkpoints: what is saved, retention, resume, refusal, and damage (in-process, small runs)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses

from trainrun import rundir
from trainrun.checkpointing import integrity
from trainrun.checkpointing.checkpoints import (
    TMP_MARK,
    CheckpointError,
    Checkpoints,
    leaf_differences,
)
from trainrun.checkpointing.resume import ConfigChangedError
from trainrun.cli import main as cli_main
from trainrun.config import load_config
from trainrun.data.pipeline import ArrayBatches, BatchCursor
from trainrun.reporting.sinks.jsonl import read_metrics
from trainrun.training.loop import run

SMALL = ["steps=30", "checkpoint.every=10", "metrics.every=10", "metrics.tensorboard=false"]


def train(run_dir: Path, *overrides: str, **kwargs) -> tuple[dict, str]:
    out = io.StringIO()
    summary = run(load_config("mlp", [*SMALL, *overrides]), run_dir, out=out, **kwargs)
    return summary, out.getvalue()


def listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> np.ndarray:
    """The losses of an uninterrupted 40-step run, which every resumed run must equal."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    train(run_dir, "steps=40")
    return losses(run_dir)


# ---- what a checkpoint holds -----------------------------------------------------------------


def test_checkpoint_holds_whole_state_data_position_and_metadata(tmp_path):
    config = load_config("mlp", [*SMALL, "checkpoint.keep=2"])
    arrays = {"x": np.arange(40, dtype=np.float32).reshape(20, 2)}
    cursor = BatchCursor(ArrayBatches(arrays, 4, shuffle=True, seed=0))
    state = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "step": jnp.int32(7),
             "key": jax.random.key(42), "count": jnp.ones((), jnp.int32)}
    ckpts = Checkpoints(tmp_path / "ckpt", config, {"jax": jax.__version__})
    for step in (10, 20, 30):
        next(cursor)
        ckpts.save(step, jax.tree.map(lambda x: x, state), cursor)
    ckpts.wait()
    assert ckpts.steps() == [20, 30]  # keep=2: the oldest is gone

    fresh_cursor = BatchCursor(cursor.dataset)
    target = jax.eval_shape(lambda: state)
    with Checkpoints(tmp_path / "ckpt", config, {}) as reopened:
        restored = reopened.restore(target, fresh_cursor, lambda meta: None)
    assert restored.step == 30 and restored.moved == []
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # typed key comes back typed
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert fresh_cursor.get_state() == {"next_index": 3}
    meta = restored.metadata
    assert meta["config"] == config.to_dict() and meta["provenance"] == {"jax": jax.__version__}
    assert meta["key_impls"] == {"key": "key<fry>"} and meta["step"] == 30
    ckpts.close()


def test_async_save_is_a_snapshot_though_the_state_is_donated_next(tmp_path):
    """The loop donates the state to the next call while the save is still being written."""
    update = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.5 + 1.0, s), donate_argnums=0)
    state = update({"w": jnp.ones((1000, 1000)), "v": jnp.arange(100_000, dtype=jnp.float32)})
    snapshot = jax.tree.map(lambda x: np.array(x, copy=True), state)
    with Checkpoints(tmp_path, load_config("mlp"), {}) as ckpts:
        ckpts.save(1, state, None)
        for _ in range(5):
            state = update(state)
        jax.block_until_ready(state)
        ckpts.wait()
        restored = ckpts.restore(jax.eval_shape(lambda: snapshot), None, lambda meta: None)
    for name, value in snapshot.items():
        assert np.asarray(restored.state[name]).tobytes() == value.tobytes()


# ---- resume ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_extends_a_finished_run_bit_for_bit(tmp_path, whole):
    """Calls are cut at checkpoint steps (K=4 -> 4, 4, 2 up to 10), and K may change."""
    train(tmp_path / "split", "steps=20", "steps_per_call=4")
    ckpt_dir = tmp_path / "split" / "checkpoints"
    assert Checkpoints(ckpt_dir, load_config("mlp"), {}).steps() == [10, 20]
    _, out = train(tmp_path / "split", "steps=40", "steps_per_call=3")
    assert "resumed from step 20" in out and "warning" not in out
    assert Checkpoints(ckpt_dir, load_config("mlp"), {}).steps() == [20, 30, 40]  # keep=3
    assert [r["step"] for r in read_metrics(tmp_path / "split" / rundir.METRICS)] == list(
        range(1, 41))
    assert losses(tmp_path / "split").tobytes() == whole.tobytes()


@pytest.mark.slow
def test_extending_a_schedule_that_spans_the_run_warns(tmp_path):
    cosine = ["optimizer.schedule.kind=cosine", "optimizer.schedule.warmup=5"]
    train(tmp_path / "run", "steps=20", *cosine)
    _, out = train(tmp_path / "run", "steps=30", *cosine)
    assert "resumed from step 20" in out
    assert "schedule spans the run's length: with steps=30 (was 20) it differs from step 20" in out


def test_finished_run_says_how_to_extend_or_start_over(tmp_path):
    first, _ = train(tmp_path / "run")
    before = listing(tmp_path / "run")
    again, out = train(tmp_path / "run")
    assert "is finished" in out and "steps=N" in out and "--fresh" in out
    assert again.final_loss == first.final_loss
    assert listing(tmp_path / "run") == before

    _, out = train(tmp_path / "run", fresh=True)
    assert "moved the previous run aside" in out and "resumed" not in out
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and listing(aside[0]) == before  # moved, not deleted


@pytest.mark.slow
def test_changed_trajectory_keys_are_refused_then_allowed(tmp_path):
    train(tmp_path / "run", "steps=20")
    before = listing(tmp_path / "run")
    with pytest.raises(ConfigChangedError, match=r"optimizer\.lr: 0\.01 -> 0\.02.*seed: 0 -> 1"):
        train(tmp_path / "run", "steps=30", "optimizer.lr=0.02", "seed=1")
    assert listing(tmp_path / "run") == before  # refused before anything was written
    _, out = train(tmp_path / "run", "steps=30", "optimizer.lr=0.02", "seed=1",
                   allow_config_change=True)
    assert "resumed from step 20" in out and "changed config" in out


def test_other_model_is_an_error_naming_leaves_and_touches_nothing(tmp_path):
    train(tmp_path / "run", "steps=20")
    before = listing(tmp_path / "run")
    code = cli_main(["train", "--run-dir", str(tmp_path / "run"), "--allow-config-change",
                     *SMALL, "model.hidden=[16]"])
    assert code == 2
    assert listing(tmp_path / "run") == before
    with pytest.raises(CheckpointError, match=r"different model: params\.b1 is float32\[32\] "
                                              r"in the checkpoint, float32\[16\] here"):
        train(tmp_path / "run", "model.hidden=[16]", allow_config_change=True)


def test_leaf_differences_names_shape_dtype_and_missing_leaves():
    saved = {"params": {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32),
                        "old": jax.ShapeDtypeStruct((1,), jnp.float32)}}
    target = {"params": {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16),
                         "new": jax.ShapeDtypeStruct((4,), jnp.float32)}}
    assert leaf_differences(saved, target, {}) == [
        "params.new float32[4] is not in the checkpoint",
        "params.w is float32[2, 3] in the checkpoint, bfloat16[2, 3] here",
        "params.old is in the checkpoint but not in this model"]


def test_provenance_change_warns_that_bits_are_not_promised(tmp_path):
    train(tmp_path / "run", "steps=20")
    meta_file = tmp_path / "run" / "checkpoints" / "20" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["provenance"]["jax"] = "0.4.38"
    meta_file.write_text(json.dumps(meta))
    integrity.write_manifest(meta_file.parent)  # as if saved so: its checksums match
    _, out = train(tmp_path / "run", "steps=30")
    assert "warning" in out and "jax 0.4.38 -> " in out and "not promised" in out
    assert "resumed from step 20" in out


# ---- damage ----------------------------------------------------------------------------------


def _truncate_arrays(step_dir: Path) -> None:
    files = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    assert files
    for p in files:
        p.write_bytes(p.read_bytes()[:7])


def _delete_position(step_dir: Path) -> None:
    for p in (step_dir / "data").glob("process_*.json"):
        p.unlink()


# A failed read of a damaged file leaves a callback of tensorstore's for an asyncio loop Orbax
# has already closed; Python reports it as unraisable. It is the damage being detected.
tolerate_failed_reads = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


@tolerate_failed_reads
@pytest.mark.parametrize("damage", [_truncate_arrays, _delete_position])
def test_corrupt_latest_falls_back_to_the_previous_one(tmp_path, whole, damage):
    train(tmp_path / "run")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    damage(ckpt_dir / "30")
    _, out = train(tmp_path / "run", "steps=40")  # resumes from 20, redoes 21..40
    assert "warning: checkpoint step 30 cannot be read" in out
    assert "resumed from step 20" in out
    moved = list((ckpt_dir / "corrupt").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["30"]  # moved aside, not deleted
    assert losses(tmp_path / "run").tobytes() == whole.tobytes()
    assert Checkpoints(ckpt_dir, load_config("mlp"), {}).steps() == [20, 30, 40]


@tolerate_failed_reads
def test_no_readable_checkpoint_is_an_error_and_moves_nothing(tmp_path):
    train(tmp_path / "run", "steps=20")
    for step in ("10", "20"):
        _truncate_arrays(tmp_path / "run" / "checkpoints" / step)
    before = listing(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"no checkpoint .* can be read: step 20: .*"
                                              r"step 10: .*--fresh"):
        train(tmp_path / "run")
    assert listing(tmp_path / "run") == before


@tolerate_failed_reads
def test_partial_save_is_never_restored_and_never_blocks(tmp_path, whole):
    """A step directory whose save never finished (Orbax's temporary name) is skipped and
    removed; the run resumes from the last committed step and saves that step again."""
    train(tmp_path / "run", "steps=20")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    partial = ckpt_dir / f"30{TMP_MARK}"
    shutil.copytree(ckpt_dir / "20", partial)  # looks complete inside: still not a step
    _truncate_arrays(partial)
    _, out = train(tmp_path / "run", "steps=40")
    assert "resumed from step 20" in out and f"30{TMP_MARK}" in out
    assert not partial.exists()
    assert Checkpoints(ckpt_dir, load_config("mlp"), {}).steps() == [20, 30, 40]
    assert losses(tmp_path / "run").tobytes() == whole.tobytes()


def test_metrics_cut_back_to_the_restored_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
                    + json.dumps({"step": 2, "split": "eval", "loss": 2.0}) + "\n"
                    + '{"step": 6, "lo')  # a line torn by a kill
    assert rundir.truncate_metrics(path, 3) == 3
    assert [(r["step"], r.get("split")) for r in map(json.loads, path.read_text().splitlines())
            ] == [(1, None), (2, None), (3, None), (2, "eval")]


def test_a_garbled_metrics_line_is_dropped_with_the_steps_after_the_restore(tmp_path):
    """Extending a run whose metrics.jsonl held a non-UTF-8 line ended in a traceback
    (UnicodeDecodeError); the line is no record, like a torn one, and is dropped."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(json.dumps({"step": s}).encode() + b"\n" for s in (1, 2, 3))
                     + b"\xff\xfe garbage\n" + json.dumps({"step": 4}).encode() + b"\n")
    assert rundir.truncate_metrics(path, 3) == 2
    assert [r["step"] for r in map(json.loads, path.read_text().splitlines())] == [1, 2, 3]
