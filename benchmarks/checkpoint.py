"""What checkpoints cost: for a ~100 MB train state, the time the loop is blocked by an
asynchronous save vs a synchronous one, the restore time, and the overhead of a checkpoint
every 100 steps in a whole run (the loop's time blocked on checkpoints, against its step
compute; the final checkpoint, which every run writes, is the baseline).

    python benchmarks/checkpoint.py [--hidden 2900] [--steps 300] [--repeats 3]

The state is the MLP ``8 -> hidden -> hidden -> 1`` with Adam: params plus two moments, about
``3 * 4 * hidden**2`` bytes (100 MB at hidden 2900). Save and restore go through
``trainrun.checkpointing.checkpoints.Checkpoints`` (Orbax), the run through ``trainrun.run``;
contenders are interleaved and medians over ``--repeats`` reported. Target: an async save
blocks the loop for at most 25% of a synchronous save.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import jax

from trainrun.checkpointing.checkpoints import Checkpoints
from trainrun.config import load_config
from trainrun.data import batch_iterator, build_dataset
from trainrun.models import build_model
from trainrun.platform.process import configure_process
from trainrun.program.optim import build_optimizer
from trainrun.program.state import init_state
from trainrun.training.loop import run


def config_for(hidden: int, steps: int, *overrides: str):
    return load_config("mlp", [f"model.hidden=[{hidden},{hidden}]", f"steps={steps}",
                               "data.batch_size=8", "optimizer.lr=0.0001", "metrics.every=100",
                               "metrics.tensorboard=false", *overrides])


def state_bytes(state) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def time_saves(config, state, iterator, root: Path, repeats: int) -> dict[str, list[float]]:
    """Blocking time of sync and async saves, the async commit time, and restore time."""
    times: dict[str, list[float]] = {"sync": [], "async": [], "async_commit": [], "restore": []}
    target = jax.eval_shape(lambda: state)
    for r in range(repeats):
        for mode in ("sync", "async"):
            cfg = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
                update={"async_": mode == "async"})})
            with Checkpoints(root / f"{mode}-{r}", cfg, {}) as ckpts:
                start = time.perf_counter()
                ckpts.save(1, state, iterator)
                blocked = time.perf_counter() - start
                ckpts.wait()
                times[mode].append(blocked)
                if mode == "async":
                    times["async_commit"].append(time.perf_counter() - start)
        with Checkpoints(root / f"sync-{r}", config, {}) as ckpts:
            start = time.perf_counter()
            restored = ckpts.restore(target, iterator, lambda meta: None)
            jax.block_until_ready(restored.state)
            times["restore"].append(time.perf_counter() - start)
    return times


def time_runs(hidden: int, steps: int, root: Path, repeats: int) -> dict[str, list[dict]]:
    """Whole runs: no periodic checkpoint, every 100 steps async, every 100 steps sync. Each
    gives the loop's step-compute time and the time it was blocked on checkpoints (the final
    save included), from its summary: wall time itself swings with the machine's load."""
    contenders = {
        "final checkpoint only": ["checkpoint.every=0"],
        "every 100 steps, async": ["checkpoint.every=100", "checkpoint.async=true"],
        "every 100 steps, sync": ["checkpoint.every=100", "checkpoint.async=false"],
    }
    results: dict[str, list[dict]] = {name: [] for name in contenders}
    for r in range(repeats):
        for i, (name, overrides) in enumerate(contenders.items()):
            config = config_for(hidden, steps, *overrides)
            summary = run(config, root / f"run-{r}-{i}", out=io.StringIO())
            split = summary.wall_time_split_s
            results[name].append({"compute": split["step_compute"],
                                  "blocked": split["checkpoint"],
                                  "median_step": summary.step_time_median_s})
    return results


def main() -> None:
    configure_process()  # as `trainrun train` does, before the first computation
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2900)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = config_for(args.hidden, args.steps)
    model, optimizer = build_model(config.model), build_optimizer(config.optimizer, config.steps)
    state = jax.block_until_ready(init_state(model, optimizer, config.seed))
    iterator = batch_iterator(build_dataset(config.data, config.seed))
    mb = state_bytes(state) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        saves = time_saves(config, state, iterator, Path(tmp), args.repeats)
        runs = time_runs(args.hidden, args.steps, Path(tmp), args.repeats)

    med = {name: statistics.median(values) for name, values in saves.items()}
    print(f"state {mb:.1f} MB (MLP 8 -> {args.hidden} -> {args.hidden} -> 1, adam), "
          f"median of {args.repeats}; jax {jax.__version__}, {jax.default_backend()}\n")
    print("| operation | seconds | vs sync save |")
    print("|---|---:|---:|")
    rows = [("sync save (loop blocked)", med["sync"]),
            ("async save: loop blocked", med["async"]),
            ("async save: until committed (background)", med["async_commit"]),
            ("restore", med["restore"])]
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {seconds / med['sync']:.2f}x |")
    ratio = med["async"] / med["sync"]
    print(f"\nasync blocking / sync save = {ratio:.0%} (target <= 25%: "
          f"{'met' if ratio <= 0.25 else 'NOT met'})\n")

    base = runs["final checkpoint only"]
    base_compute = statistics.median(r["compute"] for r in base)
    base_blocked = statistics.median(r["blocked"] for r in base)
    print(f"| {args.steps}-step run | step compute s | blocked on checkpoints s | "
          "added blocking / step compute |")
    print("|---|---:|---:|---:|")
    for name, results in runs.items():
        compute = statistics.median(r["compute"] for r in results)
        blocked = statistics.median(r["blocked"] for r in results)
        print(f"| {name} | {compute:.2f} | {blocked:.2f} | "
              f"{(blocked - base_blocked) / base_compute:+.1%} |")
    step_s = statistics.median(r["median_step"] for r in base)
    print(f"\nper checkpoint every 100 steps: async blocks {med['async']:.3f} s against "
          f"100 x {step_s:.3f} s of steps = {med['async'] / (100 * step_s):.1%}; "
          f"sync {med['sync'] / (100 * step_s):.1%}")


if __name__ == "__main__":
    main()
