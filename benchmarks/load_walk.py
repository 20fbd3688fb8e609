"""The walk of ``trainrun.load(path)``: which trainrun modules its call runs code in, and how
control moves between them, from a profile of every call and return (``sys.setprofile``).

    rooms     the trainrun modules that run code during the call
    returns   the pairs of modules (callee -> caller) across which a call returns
    climbs    the pairs of modules across which control goes from a lower floor to a higher one
              (docs/internals.md's floors): a return up from the floor below, or a call into a
              floor above (a callback)
    asks      calls, anywhere in the walk, of the function that parses a path for its store

Each pair counts once, however often it is crossed; ``--counts`` also gives every crossing.
The run directory is trained first (a tiny transformer, two steps) unless it holds one; the
walk is of a second ``load``, once the imports and compilations of the first are done.

    python benchmarks/load_walk.py [--run DIR] [--counts]
"""

from __future__ import annotations

import argparse
import collections
import io
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

# Low to high, as docs/internals.md lays them out: a module may import its floor and below.
FLOORS = [
    ("trainrun.errors", "trainrun.extras"),
    ("trainrun.config",),
    ("trainrun.platform",),
    ("trainrun.storage",),
    ("trainrun.models", "trainrun.data"),
    ("trainrun.rundir",),
    ("trainrun.reporting",),
    ("trainrun.program",),
    ("trainrun.fast",),
    ("trainrun.checkpointing",),
    ("trainrun.training",),
    ("trainrun.evaluation",),
    ("trainrun", "trainrun.cli", "trainrun.export", "trainrun.verify_resume", "trainrun.__main__"),
]


def floor(module: str) -> int:
    best, found = -1, 0
    for index, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    return found


def _ours(frame: FrameType | None) -> str | None:
    """The nearest trainrun module on the stack from ``frame`` up."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "trainrun" or name.startswith("trainrun."):
            return name
        frame = frame.f_back
    return None


def walk(path: str) -> dict[str, Any]:
    """The rooms, returns, climbs and asks of ``trainrun.load(path)``."""
    import trainrun

    events: list[tuple[str, str, str, str | None]] = []

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event not in ("call", "return"):
            return
        name = frame.f_globals.get("__name__", "")
        if name == "trainrun" or name.startswith("trainrun."):
            events.append((event, name, frame.f_code.co_name, _ours(frame.f_back)))

    sys.setprofile(profile)
    try:
        trainrun.load(path)
    finally:
        sys.setprofile(None)
    returns: collections.Counter[tuple[str, str]] = collections.Counter()
    climbs: collections.Counter[tuple[str, str]] = collections.Counter()
    for event, name, _, caller in events:
        if caller is None or caller == name:
            continue
        low, high = (name, caller) if event == "return" else (caller, name)
        if event == "return":
            returns[(name, caller)] += 1
        if floor(high) > floor(low):
            climbs[(low, high)] += 1
    asks = sum(1 for event, name, function, _ in events
               if event == "call" and function == "is_remote")
    return {"rooms": sorted({name for _, name, _, _ in events}, key=floor),
            "returns": returns, "climbs": climbs, "asks": asks}


def _train(run: Path) -> None:
    import trainrun
    from trainrun.config import config_from_dict

    config = config_from_dict({
        "steps": 2, "model": {"kind": "transformer", "d_model": 32, "layers": 1, "heads": 2},
        "data": {"kind": "records", "synthetic": "reverse", "synthetic_examples": 64,
                 "seq_len": 32, "batch_size": 8}})
    trainrun.run(config, run, out=io.StringIO())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="a run directory (trained here when it holds none)")
    parser.add_argument("--counts", action="store_true", help="every crossing, not each pair")
    args = parser.parse_args()
    run = Path(args.run or tempfile.mkdtemp(prefix="trainrun-walk-")) / "run"
    if not (run / "config.yaml").is_file():
        _train(run)
    import trainrun

    trainrun.load(str(run))  # the imports and compilations, outside the walk
    found = walk(str(run))
    print(f"rooms {len(found['rooms'])}, climbs back up {len(found['climbs'])}, "
          f"returns {len(found['returns'])}, is_remote asks {found['asks']}")
    if args.counts:
        print(f"crossings: climbs {sum(found['climbs'].values())}, "
              f"returns {sum(found['returns'].values())}")
    for (low, high), times in sorted(found["climbs"].items(), key=lambda c: floor(c[0][1])):
        print(f"  climb {low} ({floor(low)}) -> {high} ({floor(high)}) x{times}")


if __name__ == "__main__":
    main()
