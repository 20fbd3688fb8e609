"""``trainrun verify-resume``: a killed and resumed run equals an uninterrupted one, bit for bit.

    uninterrupted         train the config to the end in a fresh process
    kill at a checkpoint  train it again; the process SIGKILLs itself once the checkpoint at STEP
                          is committed (or right after the asynchronous save of STEP started,
                          its files still being written); then a new process resumes it
    kill in the reference a preference run with a cached reference: train it again with a cache
                          of its own; the process SIGKILLs itself when the reference column is
                          written but its folder not yet committed; then a new process
                          starts it again on what the kill left
    kill in generation    a reinforcement-learning run: train it again; once the checkpoint at
                          STEP is committed, the process SIGKILLs itself while its decoder
                          draws the next rollouts; then a new process resumes it from STEP
    compare               every step's loss and grad norm from metrics.jsonl (float32 bits), and
                          a sha256 of the final checkpoint's state arrays and data position

The kill is a real ``kill -9`` (no handler runs, no file is closed), sent by the process to
itself so that the kill point is exact: the runs are ``trainrun train`` with one callback more,
``KillAt``, which hears of each save (``Callback.on_checkpoint``); in the reference pass, the
kill follows the write of the reference's column, before its folder is renamed into place
(which commits it), and in generation a thread sends the kill as the decoder's program is
called. Kill points
are checkpoint steps (and that one), so the runs save by steps only
(``checkpoint.every_seconds=0``); a config that saves by time only is checked with a
checkpoint at half its steps. Which step a run resumed from is read
from its ``summary.json`` (``start_step``). Exit 0 only if everything matches.

The chains run at once, each in processes of its own; where one process at a time holds the
device (a TPU chip), one after another, and this process reads their checkpoints on the CPU
(``platform/accelerator.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from trainrun.checkpointing import init_from, object_store
from trainrun.checkpointing.checkpoints import TMP_MARK
from trainrun.checkpointing.integrity import MANIFEST
from trainrun.config import ConfigError, RunConfig, dump_yaml, load_config
from trainrun.errors import UserError
from trainrun.models.preference_transformer import REFERENCE_COLUMN
from trainrun.rundir import CHECKPOINTS, METRICS, committed_steps, read_summary
from trainrun.storage import location
from trainrun.storage.location import LocalLocation, Location
from trainrun.training import preference_data
from trainrun.training.callbacks import Boundary, Callback
from trainrun.training.kinds import kind_of

COMPARED = ("loss", "grad_norm")  # per-step metrics the step computes (no timings)
REFERENCE = "reference"  # the kill in a preference run's reference pass
GENERATION = "generation"  # the kill while an RL run's decoder draws rollouts


@dataclasses.dataclass
class Chain:
    """One row of the table: the uninterrupted run, or a kill and its resume."""

    label: str
    run_dir: Location
    kill: str | None = None  # "STEP:committed" | "STEP:in-save"
    problems: list[str] = dataclasses.field(default_factory=list)
    resumed_from: str = "-"
    kill_note: str = ""
    steps: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
    digest: str | None = None
    mismatch: tuple[int, str] | None = None  # (first differing step, what differed)


def verify_resume(config_name: str, overrides: list[str], *, kill_at: list[int],
                  kill_in_save: list[int], kill_in_reference: bool = False,
                  kill_in_generation: list[int] | None = None,
                  work_dir: str | None = None, keep: bool = False,
                  jobs: int | None = None, out: TextIO | None = None,
                  one_process_device: str | None = None) -> int:
    """Run the chains (at most ``jobs`` at once; by default all), compare them, print the
    table; 0 if every chain equals the uninterrupted run. one_process_device: the device the
    runs train on where one process at a time holds it (a TPU: ``accelerator.py``), which
    this process must not hold itself: the runs then go one after another."""
    shown: TextIO = sys.stdout if out is None else out  # the stdout of now, not of the import
    config = _config_to_check(config_name, overrides)
    kills = _kill_points(config, kill_at, kill_in_save, kill_in_reference, kill_in_generation)
    base, local = _work_dirs(work_dir)
    config_path = local / "config.yaml"
    config_path.write_text(dump_yaml(config))

    chains = [Chain("uninterrupted", base / "uninterrupted")]
    for step, when in kills:
        what = {"committed": f"kill -9 after checkpoint {step} committed",
                "in-save": f"kill -9 during async save of {step}",
                REFERENCE: "kill -9 in the reference pass",
                GENERATION: f"kill -9 in generation after checkpoint {step}"}[when]
        chains.append(Chain(what, base / f"kill-{when}-{step}", kill=f"{step}:{when}"))
    ckpt = config.checkpoint
    shown.write(f"verify-resume: {config.name}, {config.steps} steps, checkpoint every "
              f"{ckpt.every} ({'async' if ckpt.async_ else 'sync'}), runs in {base}\n")
    jobs = jobs or min(len(chains), os.cpu_count() or 1)
    if one_process_device is not None and len(chains) > 1:
        jobs = 1
        shown.write(f"verify-resume: one process at a time can hold the {one_process_device}: "
                    f"the {len(chains)} runs go one after another\n")
    shown.flush()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda c: _run_chain(c, config_path, local), chains))

    reference = chains[0]
    for chain in chains[1:]:
        _compare(reference, chain, config.steps)
    ok = all(not c.problems for c in chains)
    _table(chains, config.steps, shown)
    if ok:
        shown.write(f"PASS: every step's {' and '.join(COMPARED)} and the final state (params, "
                  "optimizer state, step, key, data position) are bitwise equal\n")
        if not keep:
            base.delete_tree()
            if local != base:
                shutil.rmtree(local)
    else:
        for chain in chains:
            for problem in chain.problems:
                shown.write(f"FAIL {chain.label}: {problem}\n")
        shown.write(f"runs kept in {base}\n")
    shown.flush()
    return 0 if ok else 1


def _config_to_check(config_name: str, overrides: list[str]) -> RunConfig:
    """The config with its saves by steps only (at half its steps if it saved by time only),
    resolved against its init.from source."""
    config = load_config(config_name, [*overrides, "checkpoint.dir=null",
                                       "checkpoint.every_seconds=0"])
    if not config.checkpoint.every and config.steps >= 2:  # saves by time only: pick a step
        config = load_config(config_name, [*overrides, "checkpoint.dir=null",
                                           "checkpoint.every_seconds=0",
                                           f"checkpoint.every={config.steps // 2}"])
    # Written resolved: an init.from source's architecture (and tokenizer) as the runs' own
    # values, which that source then agrees with (the defaults it replaces would not).
    return init_from.resolved(config)


def _work_dirs(work_dir: str | None) -> tuple[Location, LocalLocation]:
    """Where the runs go (``work_dir``, which must be new or empty, or a new temporary
    directory), and the local directory for their config and logs (the same one unless the
    runs are on object storage)."""
    base = location.location(work_dir) if work_dir else None  # where --work-dir enters
    if base is not None and base.local_path is None:  # the runs on object storage, the config here
        base.require_bucket("writing")
        if base.list_names():
            raise UserError(f"--work-dir {base} is not empty; its runs would be resumed, not "
                            "redone. Give a new or empty location")
        return base, location.local(tempfile.mkdtemp(prefix="trainrun-verify-"))
    if base is not None and base.exists() and not base.is_dir():
        raise UserError(f"--work-dir {work_dir} is a file; give a new or empty directory")
    local = location.local(base.local_path if base is not None and base.local_path is not None
                           else tempfile.mkdtemp(prefix="trainrun-verify-"))
    if local.exists() and any(local.iterdir()):
        raise UserError(f"--work-dir {local} is not empty; its runs would be resumed, not "
                        "redone. Give a new or empty directory")
    local.mkdir(parents=True, exist_ok=True)
    return local, local


def _kill_points(config: RunConfig, kill_at: list[int], kill_in_save: list[int],
                 kill_in_reference: bool = False,
                 kill_in_generation: list[int] | None = None) -> list[tuple[int, str]]:
    """The chains' kills, ``(step, when)``: those asked for, or without any, one after the first
    checkpoint, one during the save of the second, and for the runs that have one, one in the
    reference pass and one in generation after the first checkpoint."""
    generation = list(kill_in_generation or [])
    kind = kind_of(config)
    cached = kind.reference_pass(config)
    if kill_in_reference and not cached:
        raise ConfigError("--kill-in-reference needs a preference run whose loss has a "
                          "reference kept before training (preference.reference=cached)")
    if generation and not kind.generates:
        raise ConfigError("--kill-in-generation needs a reinforcement-learning run (an rl "
                          "section): no other run generates while it trains")
    every = config.checkpoint.every
    saves = list(range(every, config.steps, every)) if every else []
    if not (kill_at or kill_in_save or generation or kill_in_reference):
        if not saves:
            raise ConfigError(f"no checkpoint before the end to kill at: set checkpoint.every "
                              f"below steps ({config.steps})")
        kill_at = saves[:1]
        kill_in_save = (saves[1:2] or saves[:1]) if config.checkpoint.async_ else []
        generation = saves[:1] if kind.generates else []
        kill_in_reference = cached
    for step in [*kill_at, *kill_in_save, *generation]:
        if step not in saves:
            raise ConfigError(f"step {step} is not a checkpoint before the end (checkpoint."
                              f"every={every}, steps={config.steps}); kill at one of "
                              f"{', '.join(map(str, saves[:8])) or 'none: lower checkpoint.every'}")
    if kill_in_save and not config.checkpoint.async_:
        raise ConfigError("--kill-in-save needs checkpoint.async=true (a synchronous save is "
                          "committed before the run goes on)")
    return ([(s, "committed") for s in kill_at] + [(s, "in-save") for s in kill_in_save]
            + [(s, GENERATION) for s in generation]
            + ([(0, REFERENCE)] if kill_in_reference else []))


def _train(config_path: Path, run_dir: Location, log: Path, kill: str | None = None,
           cache: Path | None = None) -> subprocess.CompletedProcess:
    env = None if cache is None else {**os.environ, "TRAINRUN_CACHE_DIR": str(cache)}
    with log.open("a") as f:
        return subprocess.run(
            [sys.executable, "-m", "trainrun.verify_resume", str(config_path), str(run_dir),
             *([kill] if kill else [])], stdout=f, stderr=subprocess.STDOUT, check=False,
            env=env)


def _run_chain(chain: Chain, config_path: Path, logs: Path) -> None:
    log = logs / f"{chain.run_dir.name}.log"
    # A kill in the reference pass needs a pass to kill: a cache no other chain fills first.
    cache = logs / f"{chain.run_dir.name}.cache" if chain.kill and chain.kill.endswith(
        REFERENCE) else None
    if chain.kill:
        killed = _train(config_path, chain.run_dir, log, kill=chain.kill, cache=cache)
        if killed.returncode != -9:
            chain.problems.append(f"the run was to be killed at {chain.kill} but exited with "
                                  f"{killed.returncode}{_why(log)} (log {log})")
            return
        chain.kill_note = (_after_reference_kill(chain, cache) if cache is not None
                           else _after_kill(chain, chain.kill))
    done = _train(config_path, chain.run_dir, log, cache=cache)
    if done.returncode != 0:
        chain.problems.append(f"exit code {done.returncode}{_why(log)}; log {log}")
        return
    chain.resumed_from = str(read_summary(chain.run_dir).get("start_step", "?"))
    for record in _metrics(chain.run_dir / METRICS):
        if record["step"] in chain.steps:
            chain.problems.append(f"metrics.jsonl holds step {record['step']} twice")
            return
        chain.steps[record["step"]] = record
    chain.digest = state_digest(chain.run_dir / CHECKPOINTS, _final_step(chain))


def _metrics(path: Location) -> list[dict]:
    """The training records of a run's ``metrics.jsonl``, local or on object storage."""
    records = [json.loads(line) for line in path.read_text().splitlines()
               if line.strip()]
    return [r for r in records if r.get("split", "train") == "train"]


def _why(log: Path) -> str:
    """The last ``error:`` line a run wrote to its log, as ``: <line>``; empty if none."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith("error: ")]
    return f": {errors[-1].removeprefix('error: ')}" if errors else ""


def _after_kill(chain: Chain, kill: str) -> str:
    """What the kill left behind: for a kill during a save, whether it really was in flight."""
    step, when = kill.split(":")
    if when == GENERATION:
        return _after_generation_kill(chain, int(step))
    ckpt_dir = chain.run_dir / CHECKPOINTS
    names = ckpt_dir.list_names()
    if not ckpt_dir.renames:  # committed by its commit file; a step without is partial
        committed = int(step) in committed_steps(ckpt_dir)
        partial = step in names and not committed
    else:
        committed = step in names
        partial = any(n.startswith(step + TMP_MARK) for n in names)
    if when == "committed":
        if not committed:
            chain.problems.append(f"checkpoint {step} was not committed at the kill")
        return "committed"
    if committed:
        chain.problems.append(f"the save of {step} had already committed when the kill landed; "
                              "nothing was in flight")
        return "not in flight"
    return "in flight (partial dir left)" if partial else "in flight"


def _after_generation_kill(chain: Chain, step: int) -> str:
    """What a kill in generation left: the checkpoint at ``step`` committed, none after it."""
    committed = committed_steps(chain.run_dir / CHECKPOINTS)
    if step not in committed:
        chain.problems.append(f"checkpoint {step} was not committed when generation was killed")
    if any(later > step for later in committed):
        chain.problems.append(f"a checkpoint after {step} was committed before the kill in "
                              "generation")
    return "in flight (decoder running)"


def _after_reference_kill(chain: Chain, cache: Path) -> str:
    """What a kill in the reference pass left: a column written in its staging folder, none
    committed (renamed into place)."""
    columns = list(cache.glob(f"**/reference/*/train.{REFERENCE_COLUMN}.bin"))
    if not columns:
        chain.problems.append("the kill in the reference pass left no column written")
        return "no column"
    if any(not column.parent.name.startswith(".") for column in columns):  # not staged
        chain.problems.append("the reference column was committed when the kill landed; "
                              "nothing was in flight")
        return "committed"
    return "in flight (column written, not committed)"


def _final_step(chain: Chain) -> int:
    return committed_steps(chain.run_dir / CHECKPOINTS)[-1]


def state_digest(ckpt_dir: Location, step: int) -> str:
    """sha256 over a checkpoint's state arrays (name, dtype, shape, bytes) and data position."""
    import orbax.checkpoint as ocp

    where = (ckpt_dir / str(step)).absolute()
    if not where.renames:  # Orbax and TensorStore told how to reach the store
        object_store.prepare(where)
    step_dir = where.epath()
    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(step_dir / "state").tree
    restore_args = _tree_map_dict(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = handler.restore(step_dir / "state",
                           args=ocp.args.PyTreeRestore(restore_args=restore_args))
    handler.close()
    digest = hashlib.sha256()
    for name, leaf in sorted(_leaves(tree), key=lambda item: item[0]):
        if not isinstance(leaf, np.ndarray):  # an empty optimizer state: no bytes to compare
            digest.update(f"{name}|{leaf!r}|".encode())
            continue
        digest.update(f"{name}|{leaf.dtype}|{leaf.shape}|".encode())
        digest.update(np.ascontiguousarray(leaf).tobytes())
    for name in (where / "data").list_names():
        if name.endswith(".json") and name != MANIFEST:
            text = (where / "data" / name).read_text()
            digest.update(json.dumps(json.loads(text), sort_keys=True).encode())
    return digest.hexdigest()


def _tree_map_dict(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map_dict(fn, v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_tree_map_dict(fn, v) for v in tree)
    return fn(tree)


def _leaves(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, tree


def _bits(value: float | None) -> int | None:
    return None if value is None else int(np.float32(value).view(np.uint32))


def _compare(reference: Chain, chain: Chain, steps: int) -> None:
    if chain.problems or reference.problems:
        return
    expected = list(range(1, steps + 1))
    for c in (reference, chain):
        if sorted(c.steps) != expected:
            missing = sorted(set(expected) - set(c.steps))
            c.problems.append(f"metrics.jsonl lacks steps {missing[:5]}" if missing
                              else "metrics.jsonl holds steps past the end")
            return
    for step in expected:
        for name in COMPARED:
            a, b = reference.steps[step].get(name), chain.steps[step].get(name)
            if _bits(a) != _bits(b):
                chain.mismatch = (step, f"{name} {a!r} vs {b!r}")
                before = (" - before the resume, so two processes running the same program "
                          "disagree: see README, 'What bitwise resume needs from XLA'"
                          if chain.resumed_from.isdigit() and step <= int(chain.resumed_from)
                          else "")
                chain.problems.append(f"first mismatch at step {step}: {name} {a!r} "
                                      f"(uninterrupted) vs {b!r}{before}")
                return
    if chain.digest != reference.digest:
        chain.problems.append("final state differs (sha256 of the last checkpoint)")


def _table(chains: list[Chain], steps: int, out: TextIO) -> None:
    rows = [("run", "kill", "resumed from", "steps equal", "first mismatch", "final state")]
    for c in chains:
        equal: int | str  # steps equal, or "-" when nothing was compared
        if c.mismatch:
            equal, mismatch = c.mismatch[0] - 1, f"step {c.mismatch[0]}: {c.mismatch[1]}"
        else:
            equal, mismatch = (steps, "none") if c.steps else ("-", "-")
        state = (c.digest[:12] if c is chains[0] and c.digest
                 else "equal" if c.digest and c.digest == chains[0].digest
                 else "differs" if c.digest else "-")
        rows.append((c.label, c.kill_note or "-", c.resumed_from, str(equal), mismatch, state))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
                  + "\n")


def kill_before_reference_commit() -> None:
    """Fault injection: SIGKILL this process when its reference column is written into the
    folder being made and that folder, which the rename commits, is about to be renamed."""
    write = preference_data.write_column

    def killed(*args: Any) -> dict[str, Any]:
        write(*args)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("killed")  # not reached

    preference_data.write_column = killed  # type: ignore[assignment]


class KillInGeneration(Callback):
    """Fault injection: once the checkpoint of ``step`` is committed, SIGKILL this process as
    the decoder's program that draws the next rollouts is called (a thread sends the kill, so
    it lands while the program runs, or at its call)."""

    def __init__(self, step: int):
        self.step = step

    def on_checkpoint(self, boundary: Boundary) -> None:
        if boundary.step != self.step:
            return
        boundary.wait_for_checkpoint()
        from trainrun.program import rollouts

        made = rollouts.decoder

        def killing(*args: object, **kwargs: object) -> Callable[..., object]:
            program = made(*args, **kwargs)

            def run(*operands: object) -> object:
                threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL),
                                 daemon=True).start()
                return program(*operands)

            return run

        rollouts.decoder = killing  # type: ignore[assignment]


class KillAt(Callback):
    """Fault injection: SIGKILL this process at the checkpoint of ``step``, once it is
    committed (``when`` "committed") or right after its asynchronous save started, its files
    still being written ("in-save")."""

    def __init__(self, step: int, when: str):
        self.step, self.when = step, when

    def on_checkpoint(self, boundary: Boundary) -> None:
        if boundary.step != self.step:
            return
        if self.when == "committed":
            boundary.wait_for_checkpoint()
        os.kill(os.getpid(), signal.SIGKILL)


def train_for_check(config_path: str, run_dir: str, kill: str | None = None) -> int:
    """One run of a check, as ``trainrun train`` runs it, with ``KillAt`` when asked."""
    from trainrun.platform.distributed import session
    from trainrun.platform.process import configure_process
    from trainrun.training.loop import run

    configure_process()
    config = load_config(config_path, [])
    callbacks: list[Callback] = []
    if kill:
        step, _, when = kill.partition(":")
        if when == REFERENCE:
            kill_before_reference_commit()
        elif when == GENERATION:
            callbacks.append(KillInGeneration(int(step)))
        else:
            callbacks.append(KillAt(int(step), when))
    try:
        with session(config.distributed):
            run(config, run_dir, callbacks=callbacks)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from trainrun.platform.process import command_process

    with command_process():  # each check's run is a command of its own
        exit_code = train_for_check(*sys.argv[1:])
    sys.exit(exit_code)
