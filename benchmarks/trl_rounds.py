"""Rounds of trainrun against TRL, interleaved: in each round trainrun's contender, then TRL's at
PyTorch's default thread count and at one thread (the GRPO and DPO benchmarks' ``trl``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Result = TypeVar("Result")


def interleaved(rounds: int, ours: Callable[[], Result],
                theirs: Callable[[Path], Result], tmp: Path) -> tuple[dict[str, list[Result]],
                                                                      int]:
    """Each contender's result per round, by name (``trainrun``, ``TRL``, ``TRL, 1 thread``),
    and PyTorch's default thread count; ``theirs`` gets a new folder for each of its runs."""
    import torch

    threads = torch.get_num_threads()
    names = {threads: "TRL", 1: "TRL, 1 thread"}
    results: dict[str, list[Result]] = {"trainrun": [], **{name: [] for name in names.values()}}
    for r in range(rounds):
        results["trainrun"].append(ours())
        for count_threads, name in names.items():
            torch.set_num_threads(count_threads)
            results[name].append(theirs(tmp / f"trl{r}-{count_threads}"))
        torch.set_num_threads(threads)
    return results, threads
