"""The host worker: jobs in order, errors raised in the loop's thread; batches made ahead are the
batches the cursor would give, and the position a checkpoint saves moves only when a batch is
taken."""

from __future__ import annotations

import io

import numpy as np
import pytest

from trainrun import setup
from trainrun.config import load_config
from trainrun.data import stack_batches
from trainrun.data.pipeline import ArrayBatches, BatchCursor
from trainrun.host_worker import BatchPrefetch, HostWorker
from trainrun.loop import run


def test_jobs_run_in_order_and_an_error_comes_back_to_the_caller():
    worker = HostWorker()
    seen: list[int] = []
    for i in range(50):
        worker.submit(lambda i=i: seen.append(i))
    worker.wait()
    assert seen == list(range(50))
    worker.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        worker.wait()
    worker.stop()


def test_a_batch_made_ahead_is_the_next_one_and_the_position_moves_only_when_taken():
    arrays = {"x": np.arange(400, dtype=np.float32).reshape(100, 4), "y": np.arange(100)}
    data = ArrayBatches(arrays, 8, shuffle=True, seed=3)
    cursor, reference = BatchCursor(data), BatchCursor(data)
    worker = HostWorker()
    prefetch = BatchPrefetch(cursor, worker)
    for k in (5, 5, 3, 5):  # the third call is cut short: the batch made for 5 is dropped
        prefetch.prepare(5)
        assert cursor.get_state() == reference.get_state()  # a checkpoint here saves this
        got = prefetch.take(k)
        want = stack_batches([next(reference) for _ in range(k)])
        assert all(got[n].tobytes() == want[n].tobytes() for n in want)
    assert cursor.get_state() == {"next_index": 18}
    worker.stop()


def test_a_run_of_long_calls_takes_each_batch_but_the_first_from_the_worker(tmp_path,
                                                                            monkeypatch):
    made: list[BatchPrefetch] = []
    original = setup.build_hooks

    def spy(built, *args):
        hooks = original(built, *args)
        made.append(built.prefetch)
        return hooks

    monkeypatch.setattr(setup, "build_hooks", spy)
    monkeypatch.setattr("trainrun.loop.build_hooks", spy)
    config = load_config("mlp", ["steps=300", "steps_per_call=100", "checkpoint.every=50",
                                 "checkpoint.every_seconds=0", "metrics.tensorboard=false"])
    run(config, tmp_path, out=io.StringIO())
    assert made[0] is not None and made[0].hits == 300 // 50 - 1  # calls cut at checkpoints
